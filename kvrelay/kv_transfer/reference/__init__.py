"""Reference connectors: ExampleConnector (a whole prompt's KV saved to and loaded from a
shared folder, vLLM's SharedStorageConnector; example.py) and MultiConnector (several
connectors behind one; multi.py)."""

from kvrelay.kv_transfer.reference.example import ExampleConnector
from kvrelay.kv_transfer.reference.multi import MultiConnector

__all__ = ["ExampleConnector", "MultiConnector"]
