"""The vLLM worker extension that installs a snapshot's weights in place.

vLLM mixes this class into its worker (`LLM(worker_extension_cls=...)`); `VLLMEngine.install` calls
it through `collective_rpc`. It owns only the hand-over of a state dict to vLLM's in-place reload,
which maps Hugging Face parameter names onto vLLM's fused and CPU-packed layouts; it knows nothing
of versions, signatures or the broadcast plane. The method is not named `update_weights`: vLLM's
CPU worker already defines one, and an extension may not override it.
"""

from __future__ import annotations

from typing import Any


class WeightInstaller:
    """Mixed into vLLM's worker; `self` is that worker."""

    def echo2_install_weights(self, state: dict[str, Any]) -> int:
        """Reload every weight from `state` (parameter name -> tensor); returns the tensor count.

        With the in-process engine the dict arrives by reference, so no copy is made before vLLM's
        loader copies each tensor into its own (possibly re-packed, re-typed) parameter."""
        self.reload_weights(weights_iterator=iter(state.items()))
        return len(state)
