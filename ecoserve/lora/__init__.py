"""Multi-LoRA serving: PEFT adapters, a fixed pool of device slots, batched LoRA layers, layer-wise loading.

`LoRAManager` is what the engine holds (registration, host cache, slots, prefetch); the model runner calls
its `begin_step` before each forward pass. `LoRAAdapterError` is the clear error of an adapter that cannot
be served (it is a ValueError).
"""
from ecoserve.lora.checkpoint import LoRAAdapterError
from ecoserve.lora.manager import LoRAManager, LoRAStats

__all__ = ["LoRAAdapterError", "LoRAManager", "LoRAStats"]
