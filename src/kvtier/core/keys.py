"""Block hashes and keys.

A block hash is the chained hash of a token prefix (see `hashing`). A key tags a block
hash with the KV group it belongs to, so one prefix has one key per group. Keys are plain
`bytes` (hash bytes followed by the group id as 4 big-endian bytes, the layout vLLM uses,
so its keys are kvtier keys): hashable, compact, and cheap to compare.
"""

from __future__ import annotations

BlockHash = bytes
Key = bytes

_GROUP_ID_BYTES = 4


def make_key(block_hash: BlockHash, group_id: int) -> Key:
    """Return the key of `block_hash` in group `group_id`.

    Raises TypeError for a hash that is not bytes or a group id that is not an int (a
    bool is not), ValueError for a group id out of range.
    """
    if not isinstance(block_hash, bytes):
        raise TypeError(f"block hash must be bytes, got {block_hash!r}")
    if type(group_id) is not int:
        if isinstance(group_id, bool) or not hasattr(group_id, "__index__"):
            raise TypeError(f"group id must be an int, got {group_id!r}")
        group_id = group_id.__index__()  # a numpy int
    if not 0 <= group_id < 2 ** (8 * _GROUP_ID_BYTES):
        raise ValueError(f"group id {group_id} out of range")
    return block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big")


def key_suffix(group_id: int) -> bytes:
    """Return what `make_key` appends for `group_id`: `make_key(h, g) == h + key_suffix(g)`
    (for loops that make many keys of one group)."""
    return make_key(b"", group_id)


def key_block_hash(key: Key) -> BlockHash:
    """Return the block hash a key was made from."""
    return key[:-_GROUP_ID_BYTES]


def key_group_id(key: Key) -> int:
    """Return the group id a key was made for."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")
