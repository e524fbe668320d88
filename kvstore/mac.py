"""A tenant's MAC key: signed frames that only its writers can make (issue 13 item 4).

A frame's checksums catch accidents, not adversaries: anyone who may write a tenant's blocks
(its daemon token), a compromised daemon, or a disk can put a frame there whose checksums and
key binding verify, and a reader would restore it. With a MAC key (a secret held by the
tenant's writers and readers, the connector's `mac_key_file`, never by the daemons), writers
sign every frame (kvstore/frame.py: BLAKE3 segment checksums, then a keyed BLAKE2b over the
whole header, which binds the segment checksums, the shape and the block's key), and readers
refuse every frame without a valid MAC under that key: a miss, recomputed. Readers without a
key read signed and unsigned frames as before.

Key files: the key as hex (at least 64 hex digits: 256 bits), or raw bytes (at least 32); a
trailing newline is ignored. Printable text that is not such hex (a passphrase) is refused.
Keep one per tenant, readable by its engines only.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import ConfigError, ForgedBlock
from kvstore.frame_header import MAC_BYTES, MAC_KEY_ID_BYTES, FrameHeader

__all__ = ["MacKey", "verify_mac", "MIN_KEY_BYTES"]

MIN_KEY_BYTES = 32
_TAG_PERSON = b"kvkeep-frame"
_ID_PERSON = b"kvkeep-key-id"
_BLAKE2B_MAX_KEY = 64


@dataclass(frozen=True, slots=True)
class MacKey:
    """A secret MAC key and its public id (what a signed frame names, so a reader can tell
    "another key" from "forged")."""

    secret: bytes = field(repr=False)
    key_id: bytes = field(init=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ConfigError(f"a MAC key needs at least {MIN_KEY_BYTES} bytes of secret")
        # BLAKE2b takes keys of up to 64 bytes: a longer secret is hashed down to one.
        if len(self.secret) > _BLAKE2B_MAX_KEY:
            object.__setattr__(self, "secret", hashlib.blake2b(self.secret).digest())
        object.__setattr__(self, "key_id", hashlib.blake2b(
            self.secret, digest_size=MAC_KEY_ID_BYTES, person=_ID_PERSON).digest())

    @classmethod
    def from_file(cls, path: str | Path) -> MacKey:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read MAC key file {path}: {exc}") from exc
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            text = None
        if text is not None and text.isprintable():
            # Text: only hex of 256 bits or more. A passphrase (trust review L8) has far less
            # entropy than its length, and nothing here could tell how much.
            try:
                if len(text) < 2 * MIN_KEY_BYTES:
                    raise ValueError("too short")
                secret = bytes.fromhex(text)
            except ValueError:
                raise ConfigError(
                    f"MAC key file {path}: not a key: write at least {MIN_KEY_BYTES} random "
                    f"bytes, hex-encoded (`openssl rand -hex {MIN_KEY_BYTES}`) or raw; a "
                    "passphrase is refused") from None
        else:
            secret = raw
        try:
            return cls(secret)
        except ConfigError as exc:
            raise ConfigError(f"MAC key file {path}: {exc}") from None

    def tag(self, data: bytes) -> bytes:
        """The MAC of `data` (a frame's header bytes before its MAC)."""
        return hashlib.blake2b(data, key=self.secret, digest_size=MAC_BYTES,
                               person=_TAG_PERSON).digest()


def verify_mac(header: FrameHeader, key: MacKey) -> None:
    """Raise ForgedBlock unless `header` is signed under `key` with a valid MAC. One keyed
    hash of the header (~2 KiB): the segments it vouches for are checked by their BLAKE3
    checksums, once, where every read is verified."""
    if not header.signed:
        raise ForgedBlock("frame is not signed, and this reader requires its tenant's MAC")
    if header.mac_key_id != key.key_id:
        raise ForgedBlock(f"frame is signed by another key ({header.mac_key_id.hex()})")
    if not hmac.compare_digest(key.tag(header.mac_input()), header.mac):
        raise ForgedBlock("frame MAC does not verify")
