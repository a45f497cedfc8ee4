"""The per-session state of linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next).

Such a layer keeps no keys and values but two fixed-size states per session: the last
``kernel`` inputs of its causal convolution ``[batch, channels, kernel]`` and its recurrent
state ``[batch, heads, key_dim, value_dim]``. :class:`LinearStates` gives a session's
:class:`meshnet.models.caches.KVCache` the calls transformers' linear-attention modules make
on their cache (both spellings: transformers from 5.20 asks ``get_conv_state``, 5.17-5.19 reads
``cache.layers[i].conv_states[0]``; from 5.25 it also asks ``get_recurrent_states_to_keep`` and
calls ``increase_count``); :class:`BatchLinearStates` gives a batch of sessions one
stacked state per layer and hands each row its own back after the step. The states stay on the
hop that owns the layer; a replayed prefill rebuilds them like the KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BatchLinearStates", "LinearStates"]


class _LayerStates:
    """``cache.layers[i]`` as transformers 5.17-5.19's linear-attention modules read it."""

    record_past = False  # states are not kept per step for a rollback

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache, self.layer_idx = cache, layer_idx

    @property
    def conv_states(self) -> list[torch.Tensor | None]:
        return [self.cache.get_conv_state(self.layer_idx)]

    @property
    def recurrent_states(self) -> list[torch.Tensor | None]:
        return [self.cache.get_recurrent_state(self.layer_idx)]


class _Layers:
    def __init__(self, cache) -> None:
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> _LayerStates:
        return _LayerStates(self.cache, layer_idx)


class LinearStates:
    """A session's linear-attention states, by layer (``conv`` and ``recurrent`` dicts)."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]

    @property
    def layers(self) -> _Layers:
        return _Layers(self)

    def has_previous_state(self, layer_idx: int, state_idx: int = 0) -> bool:
        return layer_idx in self.conv

    def is_recording_past(self, layer_idx: int) -> bool:  # states are not kept per step for a rollback
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """Intermediate recurrent states kept for a rollback (transformers >= 5.25 asks): none,
        these states are never rewound (a speculating entry of such a model does not draft)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers >= 5.25 counts a decode step whose convolution updated the state in place;
        positions are counted by the session's KV lengths and the hop's calls here: nothing to do."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Layer ``layer_idx``'s convolution state (None before its first step; updated in place)."""
        return self.conv.get(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get(layer_idx)  # None before the layer's first step

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Append a chunk's convolution inputs ``[batch, channels, seq]``; returns them after the
        kept state (or after zeros up to ``conv_kernel_size`` on the first chunk), the left
        context the convolution reads, and keeps the last ``conv_kernel_size`` as the state."""
        previous = self.conv.get(layer_idx)
        kernel = conv_kernel_size or (previous.shape[-1] if previous is not None else conv_states.shape[-1])
        if previous is None:
            full = F.pad(conv_states, (max(kernel - conv_states.shape[-1], 0), 0))
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self.conv[layer_idx] = full[..., -kernel:].clone(memory_format=torch.contiguous_format)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent[layer_idx] = recurrent_states
        return recurrent_states


class BatchLinearStates:
    """A batch's linear-attention states: row ``b`` is session ``caches[b]``'s (each a
    :class:`LinearStates`). A decode step's convolution updates the stacked state in place
    (:meth:`get_conv_state` remembers the stack), and :meth:`update_recurrent_state`, the
    layer's last call, hands each row both states back."""

    caches: list
    _conv: dict[int, torch.Tensor]

    @property
    def layers(self) -> _Layers:
        return _Layers(self)

    def has_previous_state(self, layer_idx: int, state_idx: int = 0) -> bool:
        return all(cache.has_previous_state(layer_idx) for cache in self.caches)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """Intermediate recurrent states kept for a rollback (transformers >= 5.25 asks): none,
        these states are never rewound (a speculating entry of such a model does not draft)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers >= 5.25 counts a decode step whose convolution updated the state in place;
        positions are counted by the session's KV lengths and the hop's calls here: nothing to do."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' convolution states stacked ``[sessions, channels, kernel]`` (None unless every
        row has one)."""
        rows = [cache.conv.get(layer_idx) for cache in self.caches]
        if any(row is None for row in rows):
            return None
        stacked = self._conv[layer_idx] = torch.cat(rows)
        return stacked

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' recurrent states stacked (None unless every row has one)."""
        rows = [cache.recurrent.get(layer_idx) for cache in self.caches]
        return None if any(row is None for row in rows) else torch.cat(rows)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Each row's :meth:`LinearStates.update_conv_state`, the results stacked again."""
        return torch.cat([cache.update_conv_state(conv_states[row:row + 1], layer_idx, **kwargs)
                          for row, cache in enumerate(self.caches)])

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Hand row ``b`` of the new recurrent state (and of the convolution stack a decode step
        updated in place) back to session ``b``'s cache."""
        conv = self._conv.pop(layer_idx, None)
        for row, cache in enumerate(self.caches):
            cache.update_recurrent_state(recurrent_states[row:row + 1].clone(), layer_idx)
            if conv is not None:
                cache.conv[layer_idx] = conv[row:row + 1].clone()
        return recurrent_states
