"""Multi-LoRA: adapters in PEFT's format, their slots, and the batched product that applies a
different adapter (or none) to each row of one forward.

    request.py      LoRARequest (which adapter a request runs with) and its block-hash keys
    peft_format.py  adapter_config.json + adapter_model.safetensors -> per-layer A and B
    slots.py        active slots (max_loras) and host copies (max_cpu_loras), both LRU
    batched.py      the step's row -> slot map and the batched product over it
    layers.py       the model's projections wrapped so their output gets each row's delta
"""
