"""Engines a worker can drive: `sim` (latency model), `vllm`, `openai` (upstream).

The contract is `workers.engines.base.Engine`; which class runs each name the config can give
is `workers.engines.registry` (not imported here: a module that needs only the contract, such
as the sim's answers, loads no engine).
"""
