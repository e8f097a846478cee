"""Mamba and linear-attention state as kvd state parts (views, no copies).

A state layer keeps, per block (one request's running state), one page of
bytes: the conv state, then the temporal (SSM) state, then padding (vLLM's
``MambaSpec``; its CPU backend registers the page as one int8 tensor
``[num_blocks, 1, 1, page_bytes]`` per layer). Over TP each rank holds a
share of every sub-projection of the conv state (Mamba2's x, B and C; gated
delta-net's q, k and v) and of the SSM state's heads, so a TP change must
slice each sub-projection on its own. kvd describes each of them as a part:
a group of kind ``state`` whose spec has ``head`` = the part's TP-split unit,
``dim`` = the elements per head in one row, and ``token`` = the rows (the conv
state's ``state_len``; 1 for the SSM state). The part is a strided view of
the page, so every relayout (head slice, SD against DS conv layout) is the
one strided copy kvd does for attention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.core.errors import InvalidArgument
from kvd.core.spec import DTYPE_SIZES, KVCacheSpec

if TYPE_CHECKING:  # torch is imported where views are made, so the CLI starts without it
    import torch

SD, DS = "SD", "DS"  # vLLM's conv state layouts: (state_len, conv_dim) or (conv_dim, state_len)


@dataclass(frozen=True)
class ConvPart:
    name: str
    total_heads: int  # distinct heads over all TP ranks: the unit TP splits
    width: int  # elements per head in one row


def heads_on_rank(total: int, tp_size: int) -> int:
    """Heads of a part one rank holds: an equal share, or one head replicated
    where the part has fewer heads than ranks (vLLM replicates Mamba2's B and
    C when ``n_groups`` is 1 and TP is wider). ``check_tp`` refuses the rest."""
    return total // tp_size if total >= tp_size else 1


@dataclass(frozen=True)
class StateShape:
    """One state layer's page, as the model defines it (all TP ranks)."""

    conv: tuple[ConvPart, ...]
    conv_rows: int  # state_len: the conv kernel - 1 (+ speculative tokens)
    conv_dtype: str
    ssm_heads: int
    ssm_width: int  # head_dim * d_state (Mamba2), head_v_dim * head_k_dim (GDN)
    ssm_dtype: str
    conv_layout: str = SD

    def check_tp(self, tp_size: int) -> None:
        for name, total in [*((f"conv.{p.name}", p.total_heads) for p in self.conv), ("ssm", self.ssm_heads)]:
            if total % tp_size and tp_size % total:
                raise InvalidArgument(f"state.{name}.heads", total, f"must split evenly over tp_size={tp_size}, or be replicated on an equal number of its ranks")

    def conv_dim(self, tp_size: int) -> int:
        return sum(heads_on_rank(p.total_heads, tp_size) * p.width for p in self.conv)

    def page_bytes(self, tp_size: int) -> int:
        """The state's bytes on one rank (before any padding)."""
        conv = self.conv_rows * self.conv_dim(tp_size) * DTYPE_SIZES[self.conv_dtype]
        return conv + heads_on_rank(self.ssm_heads, tp_size) * self.ssm_width * DTYPE_SIZES[self.ssm_dtype]

    def part_names(self) -> list[str]:
        return [f"conv.{p.name}" for p in self.conv] + ["ssm"]

    def specs(self, tp_size: int, num_blocks: int) -> list[KVCacheSpec]:
        """One spec per part, on a rank of ``tp_size``: conv parts first, then the SSM state."""
        self.check_tp(tp_size)
        conv_order = ("block", "token", "head", "dim") if self.conv_layout == SD else ("block", "head", "dim", "token")
        out = [KVCacheSpec(block_size=self.conv_rows, num_kv_heads=heads_on_rank(p.total_heads, tp_size), head_size=p.width,
                           dtype=self.conv_dtype, layout=conv_order, num_blocks=num_blocks, state=True,
                           total_heads=_replicated(p.total_heads, tp_size)) for p in self.conv]
        out.append(KVCacheSpec(block_size=1, num_kv_heads=heads_on_rank(self.ssm_heads, tp_size), head_size=self.ssm_width, dtype=self.ssm_dtype,
                               layout=("block", "token", "head", "dim"), num_blocks=num_blocks, state=True,
                               total_heads=_replicated(self.ssm_heads, tp_size)))
        return out

    def views(self, page: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
        """Each part as a view of ``page``, a rank's ``[num_blocks, ...,
        page_bytes]`` byte tensor (padding allowed), shaped in the order of
        its spec's layout (``specs``)."""
        self.check_tp(tp_size)
        nb = page.shape[0]
        flat = page.reshape(nb, -1)
        if flat.element_size() != 1 or flat.shape[1] < self.page_bytes(tp_size):
            raise InvalidArgument("state.page", list(page.shape), f"must be bytes, at least {self.page_bytes(tp_size)} per block")
        stride_bytes = flat.stride(0)
        out: list[torch.Tensor] = []
        conv_dim, rows = self.conv_dim(tp_size), self.conv_rows
        csize = DTYPE_SIZES[self.conv_dtype]
        col = 0
        for p in self.conv:
            heads = heads_on_rank(p.total_heads, tp_size)
            if self.conv_layout == SD:  # rows of conv_dim: this part is columns [col, col + heads * width) of each
                offset, strides = col, (stride_bytes // csize, conv_dim, p.width, 1)
            else:  # conv_dim rows of state_len: this part is rows [col, ...)
                offset, strides = col * rows, (stride_bytes // csize, 1, p.width * rows, rows)
            view = _typed(flat, self.conv_dtype, offset * csize, (nb, rows, heads, p.width), strides)
            out.append(view if self.conv_layout == SD else view.permute(0, 2, 3, 1))  # shaped in its spec's layout order
            col += heads * p.width
        ssize = DTYPE_SIZES[self.ssm_dtype]
        heads = heads_on_rank(self.ssm_heads, tp_size)
        out.append(_typed(flat, self.ssm_dtype, rows * conv_dim * csize, (nb, 1, heads, self.ssm_width),
                          (stride_bytes // ssize, heads * self.ssm_width, self.ssm_width, 1)))
        return out


    def layer_parts(self, pages: Mapping[str, torch.Tensor], tp_size: int) -> list[tuple[KVCacheSpec, dict[str, torch.Tensor]]]:
        """Every layer's page (by name) cut into parts: per part, its spec and
        each layer's view of it, as a worker registers them (one group each)."""
        views = {name: self.views(page, tp_size) for name, page in pages.items()}
        blocks = next(iter(pages.values())).shape[0]
        return [(spec, {name: v[i] for name, v in views.items()}) for i, spec in enumerate(self.specs(tp_size, blocks))]


def _replicated(total: int, tp_size: int) -> int:
    """A spec's ``total_heads``: the distinct heads where ranks replicate them, else 0."""
    return total if total < tp_size else 0


def _typed(flat: torch.Tensor, dtype: str, offset_bytes: int, shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """A strided view of ``dtype`` elements over the bytes of ``flat`` (its storage, from ``flat``'s start)."""
    import torch

    from kvd.caches import torch_dtype

    size = DTYPE_SIZES[dtype]
    if flat.stride(0) % size or offset_bytes % size or (flat.storage_offset() * flat.element_size()) % size:
        raise InvalidArgument("state.page", list(flat.shape), f"does not align {dtype} parts (offset {offset_bytes} bytes)")
    base = torch.as_strided(flat, (flat.shape[0] * flat.stride(0),), (1,)).view(torch_dtype(dtype))
    # as_strided's offset counts from the storage's start, not the view's
    return torch.as_strided(base, tuple(shape), tuple(strides), base.storage_offset() + offset_bytes // size)


def mamba2(*, num_heads: int, head_dim: int, n_groups: int, d_state: int, conv_kernel: int, dtype: str, ssm_dtype: str = "",
           conv_layout: str = SD, num_spec: int = 0) -> StateShape:
    """A Mamba2 layer (vLLM's ``mamba2_state_shape``): conv over x | B | C."""
    return StateShape(
        conv=(ConvPart("x", num_heads, head_dim), ConvPart("B", n_groups, d_state), ConvPart("C", n_groups, d_state)),
        conv_rows=conv_kernel - 1 + num_spec, conv_dtype=dtype, ssm_heads=num_heads, ssm_width=head_dim * d_state,
        ssm_dtype=ssm_dtype or dtype, conv_layout=conv_layout,
    )


def gated_delta_net(*, k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv_kernel: int, dtype: str, ssm_dtype: str = "",
                    conv_layout: str = SD, num_spec: int = 0) -> StateShape:
    """A gated delta-net layer (Qwen3-Next; vLLM's ``gated_delta_net_state_shape``): conv over q | k | v."""
    return StateShape(
        conv=(ConvPart("q", k_heads, k_dim), ConvPart("k", k_heads, k_dim), ConvPart("v", v_heads, v_dim)),
        conv_rows=conv_kernel - 1 + num_spec, conv_dtype=dtype, ssm_heads=v_heads, ssm_width=v_dim * k_dim,
        ssm_dtype=ssm_dtype or dtype, conv_layout=conv_layout,
    )
