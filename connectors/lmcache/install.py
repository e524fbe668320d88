"""Prepare an LMCache environment for the kvkeep plugin; run it with THAT environment's python:

    /path/to/lmcache-venv/bin/python -m connectors.lmcache.install [--site DIR] [--no-check]

kvkeep's runtime dependencies pin protobuf >= 7.35 (its committed stubs need it); LMCache 0.5
pins protobuf < 7. The plugin's environment keeps LMCache's pins: kvkeep goes in without its
own dependency floors (`pip install --no-deps`, or a checkout on PYTHONPATH, plus the libraries
the plugin uses), and this script generates kvkeep's gRPC stubs from proto/*.proto with the
environment's own grpcio-tools into `<site-packages>/kvkeep_lmcache_stubs/`, which a .pth file
puts in front of `kvstore._proto` at start-up (connectors/lmcache/stub_finder.py). It imports
the plugin's transport in a fresh interpreter to prove the stubs load. Re-run it after the
.proto files change; it replaces what it wrote before.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from connectors.lmcache import stub_finder
from kvstore.errors import ConfigError

__all__ = ["PACKAGE", "install_stubs", "check_import", "main"]

PACKAGE = "kvkeep_lmcache_stubs"
_PTH = f"import {PACKAGE}; {PACKAGE}.install()\n"
_KVKEEP_ROOT = Path(__file__).resolve().parents[2]


def install_stubs(site: Path) -> Path:
    """Generate the stubs into `site`/PACKAGE/proto_gen and enable them; return the package."""
    # Loaded by path: proto/ is a folder, not a package (the name `proto` is proto-plus's).
    spec = importlib.util.spec_from_file_location("kvkeep_proto_generate",
                                                  _KVKEEP_ROOT / "proto" / "generate.py")
    if spec is None or spec.loader is None:
        raise ConfigError(f"kvkeep's proto/generate.py is not under {_KVKEEP_ROOT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generate = module.generate
    if importlib.util.find_spec("grpc_tools") is None:  # say so before writing anything
        raise ConfigError("this environment has no grpcio-tools: pip install grpcio-tools "
                          "at the version of its grpcio")
    package = site / PACKAGE
    staging = site / f".{PACKAGE}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generate(staging / "proto_gen")
    shutil.copyfile(Path(stub_finder.__file__), staging / "__init__.py")
    shutil.rmtree(package, ignore_errors=True)
    staging.rename(package)
    (site / f"{PACKAGE}.pth").write_text(_PTH)
    return package


def check_import(python: str = sys.executable) -> None:
    """Import the plugin's transport (which loads kvkeep's stubs) in a fresh interpreter."""
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_KVKEEP_ROOT),
                                                      env.get("PYTHONPATH")]))
    probe = ("import google.protobuf, kvstore._proto.kvstore_pb2 as pb;"
             "import connectors.lmcache.transport; print(google.protobuf.__version__, pb.__file__)")
    done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise ConfigError(f"kvkeep's stubs do not load here:\n{done.stderr[-2000:]}")
    print(f"kvkeep stubs load: protobuf {done.stdout.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                        help="site-packages to install into (default: this interpreter's)")
    parser.add_argument("--no-check", action="store_true", help="skip the import check")
    args = parser.parse_args(argv)
    try:
        package = install_stubs(args.site)
        print(f"kvkeep stubs for this environment: {package}")
        if not args.no_check:
            check_import()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
