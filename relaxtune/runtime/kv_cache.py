"""One sequence in TVM's paged KV cache, driven through the runtime's builtins.

The cache object (pages, sequence lengths, page tables) lives in the TVM runtime; it is made by the
artifact's ``create_paged_kv_cache`` and every forward call is bracketed as MLC-LLM drives it:
``kv_state_begin_forward(cache, [seq], [length])`` → ``prefill`` / ``decode`` → ``kv_state_end_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

SEQUENCE = 0


def _builtin(name: str):
    import tvm

    return tvm.get_global_func(name)


@dataclass
class KVCache:
    """A cache of `capacity` positions holding one sequence (`length` of them filled)."""

    handle: object
    capacity: int
    length: int = 0

    @staticmethod
    def create(vm, capacity: int, prefill_chunk: int, page_size: int) -> KVCache:
        from tvm_ffi import Shape

        pages = -(-capacity // page_size) * page_size
        # max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
        handle = vm["create_paged_kv_cache"](*(Shape([v]) for v in (1, pages, prefill_chunk, page_size, 0)))
        _builtin("vm.builtin.kv_state_add_sequence")(handle, SEQUENCE)
        return KVCache(handle, capacity)

    def begin(self, length: int) -> None:
        from tvm_ffi import Shape

        _builtin("vm.builtin.kv_state_begin_forward")(self.handle, Shape([SEQUENCE]), Shape([length]))

    def end(self, length: int) -> None:
        _builtin("vm.builtin.kv_state_end_forward")(self.handle)
        self.length += length

    def clear(self) -> None:
        """Empty the sequence (the pages stay allocated for the next one)."""
        _builtin("vm.builtin.kv_state_remove_sequence")(self.handle, SEQUENCE)
        _builtin("vm.builtin.kv_state_add_sequence")(self.handle, SEQUENCE)
        self.length = 0

    def pop(self, count: int) -> None:
        """Drop the last `count` positions."""
        _builtin("vm.builtin.kv_state_popn")(self.handle, SEQUENCE, count)
        self.length -= count
