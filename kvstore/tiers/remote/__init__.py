"""The remote tier (kvkeep daemons): `tier.py` (RemoteTier), its settings (`config.py`), the
daemon set and its breakers (`peers.py`, `resilience.py`), where blocks go (`placement.py`), and
the calls it makes (`calls.py`, `writes.py`, `repair.py`)."""
