"""The LoRA adapters a gateway serves by name: --lora-modules at start-up and, where
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (vLLM's switch), those loaded and unloaded at run
time through vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Every load takes a new lora_int_id. The worker keys its slots and host copies by the
whole LoRARequest, and the scheduler roots prefix-block hashes in it, so reloading a name
(`load_inplace`) reads the folder again and shares no KV cache with the old weights,
while requests already running finish under the adapter they started with. A gateway
keeps its own list, as each vLLM server does: behind several gateways, load on each.
"""

from __future__ import annotations

import msgspec

from services.gateway.errors import BadRequest, NotFound
from shared.lora_request import LoRARequest, check_adapter


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of this name rather than refuse


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; where given, it must be the adapter's


class LoRAModules:
    def __init__(self, base_model: str, modules: dict[str, LoRARequest]) -> None:
        self.base_model = base_model
        self._modules = dict(modules)
        self._next_id = max((m.lora_int_id for m in modules.values()), default=0) + 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self._modules.get(name) if name is not None else None

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def items(self):
        return list(self._modules.items())

    def load(self, body: LoadLoRAAdapterRequest, max_rank: int | None = None) -> LoRARequest:
        """`max_rank`: the workers' largest (None where no worker has said: the worker
        that first runs it refuses it then)."""
        name = body.lora_name
        if not name or name == self.base_model:
            raise BadRequest(f"lora_name {name!r} would hide the base model's name", "lora_name")
        if name in self._modules and not body.load_inplace:
            raise BadRequest(f"the LoRA adapter {name!r} has already been loaded (load_inplace replaces it)",
                             "lora_name")
        if max_rank == 0:
            raise BadRequest(f"LoRA adapter {name!r}: no worker serves adapters (start them with --enable-lora)",
                             "lora_name")
        try:
            path = check_adapter(name, body.lora_path, max_rank)
        except ValueError as exc:
            raise BadRequest(str(exc), "lora_path") from None
        lora = self._modules[name] = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return lora

    def unload(self, body: UnloadLoRAAdapterRequest) -> LoRARequest:
        lora = self._modules.get(body.lora_name)
        if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
            raise NotFound(f"the LoRA adapter {body.lora_name!r} cannot be found", "lora_name", "model_not_found")
        return self._modules.pop(body.lora_name)
