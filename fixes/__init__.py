"""stackfix fixes: importable workarounds for crashes in LLM RL training stacks, one package
per upstream stack (torchtitan, megatron, vllm). Optional upstream packages are imported
lazily, inside the functions that need them."""
