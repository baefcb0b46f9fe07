"""The paged KV pool: one preallocated tensor holding every layer's keys and
values in fixed-size blocks, addressed by block id.

Layout, row-major, one tensor for the whole pool:

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                               ^ 0 = K, 1 = V

so that, in bytes (``block_nbytes`` = ``num_layers * layer_nbytes``):

- one block across all layers is one contiguous range:
  ``[block * block_nbytes, (block + 1) * block_nbytes)`` — what the store keeps
  and ships whole;
- one layer of one block (its K plane, then its V plane) is one contiguous range:
  ``block * block_nbytes + layer * layer_nbytes``, ``layer_nbytes`` long — what a
  layer-wise hand-off ships, one range per block of the sequence.

Within a plane, tokens are outermost (``[block_size, num_kv_heads, head_dim]``),
so gathering a sequence's blocks gives its keys in position order with no copy
beyond the gather itself. The pool knows nothing of sequences or hashes; block
ownership is `block_pool.py`'s job.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one block; two pools with equal layouts can swap blocks byte for byte."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def plane_nbytes(self) -> int:
        """Bytes of one layer's K (or V) in one block."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer (K and V) in one block: one contiguous range."""
        return 2 * self.plane_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers: one contiguous range."""
        return self.num_layers * self.layer_nbytes

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        """A stable string naming the layout, for contracts between peers."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"blocks[L={self.num_layers},kv=2,tokens={self.block_size},"
            f"heads={self.num_kv_heads},dim={self.head_dim}]:{dtype}"
        )


class KVPool:
    """The KV tensor of one worker: ``num_blocks`` blocks laid out as the module describes."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
    ) -> None:
        """Allocate the pool, or view ``buffer`` (flat uint8, e.g. shared memory) as it."""
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape())
        if buffer is None:
            self.kv = torch.zeros(shape, dtype=layout.dtype, device=device)
        else:
            nbytes = num_blocks * layout.block_nbytes
            if buffer.dtype != torch.uint8 or buffer.numel() < nbytes:
                raise ValueError(f"buffer must be uint8 with at least {nbytes} bytes")
            self.kv = buffer[:nbytes].view(layout.dtype).view(shape)

    @classmethod
    def over(cls, kv: torch.Tensor) -> "KVPool":
        """A pool over an existing KV tensor of the module's 6-D layout (no copy)."""
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
        pool = cls.__new__(cls)
        pool.layout = KVLayout(num_layers, block_size, num_kv_heads, head_dim, kv.dtype)
        pool.num_blocks = num_blocks
        pool.kv = kv
        return pool

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_nbytes

    def keys(self, layer: int) -> torch.Tensor:
        """View of every block's keys for ``layer``: [num_blocks, block_size, H, D]."""
        return self.kv[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """View of every block's values for ``layer``: [num_blocks, block_size, H, D]."""
        return self.kv[:, layer, 1]

    def gather(self, layer: int, plane: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Copy out one plane (0 = K, 1 = V) of ``layer`` for ``block_ids`` (any shape [...]):
        returns [..., block_size, H, D].

        Indexes the pool as rows of one contiguous 2-D view, so each block's plane is
        one memcpy; advanced indexing on the strided per-layer view is several times slower.
        """
        rows = block_ids * (2 * self.layout.num_layers) + (2 * layer + plane)
        flat = self.kv.view(-1, self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim)
        out = flat.index_select(0, rows.reshape(-1))
        return out.view(*block_ids.shape, self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K and V ([T, H, D]) at (block, offset) slots, one per token."""
        self.kv[blocks, layer, 0, offsets] = k.to(self.kv.dtype)
        self.kv[blocks, layer, 1, offsets] = v.to(self.kv.dtype)

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 tensor (for byte-range transfers)."""
        return self.kv.view(-1).view(torch.uint8)

    def block_range(self, block: int, layer: int | None = None) -> tuple[int, int]:
        """(offset, length) in bytes of one block, or of one layer of one block."""
        start = block * self.layout.block_nbytes
        if layer is None:
            return start, self.layout.block_nbytes
        return start + layer * self.layout.layer_nbytes, self.layout.layer_nbytes
