"""Weights into a running engine, from a trainer: the plugin's side of vLLM's RL weight
updates, laid out as vLLM's own `distributed/weight_transfer/`.

One update, whoever drives it, is vLLM's lifecycle (`lifecycle`): start, load, finish, a
failed load undone on every rank. The weights travel as a safetensors file in a folder
private to the user (`swap_folder`), checked against the model's checkpoint (`manifest`)
before anything loads.

- the trainer's side (`trainer`): the `grpo_shm` trainer engine, which writes the file and
  drives the lifecycle through a client (`clients`: of an `LLM`, a `vllm serve`, a
  `collective_rpc`), and `LLMWeights`, through which the project's `Engine` publishes;
- the engine's side (`shm_transfer`): the `grpo_shm` transfer engine each worker loads
  with, keeping one rank's weights per role whole (`rank_weights`);
- a served engine's own route (`endpoint`, `POST /v1/grpo/weights` behind the API key and
  a weights token), and the trainer's client of it (`served_weights`).

The worker extension that adds the plugin's calls to vLLM's workers stays at the path
users name, `vllm_plugin.weight_swap.WeightSwapExtension`.
"""
