"""Engine settings of a tier: the engines there are (`EngineName`), the sim engine's latency
profile, the capacity the policy plans with, vLLM's limits and the `openai` engine's upstream.
Split from `fleet.config` by concern; `fleet.config` re-exports every name here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineName(StrEnum):
    """The engines a replica can run, named once: the config validates `engine:` against these, the
    command offers them, and `workers.engines.registry.ENGINES` maps each to its class (a test holds
    the two to each other). A str: it compares, hashes and serialises as its value."""

    SIM = "sim"  # the calibrated latency model
    VLLM = "vllm"  # vLLM in the worker's process
    OPENAI = "openai"  # forwarding to an OpenAI-compatible upstream


class _Strict(BaseModel):
    # Unknown keys are typos far more often than intent: refuse them by name.
    model_config = ConfigDict(extra="forbid")


class DecodeStep(_Strict):
    """Decode step time of a batch: base + per_seq * batch size (seconds)."""

    base_s: float = Field(0.010, ge=0)
    per_seq_s: float = Field(0.0005, ge=0)


class SimProfile(_Strict):
    """A calibrated GPU latency model for the `sim` engine and the simulator."""

    weights_gb: float = Field(2.0, ge=0)
    load_gb_s: float = Field(2.0, gt=0)
    warmup_s: float = Field(1.0, ge=0)
    prefill_tokens_per_s: float = Field(20000.0, gt=0)
    decode_step: DecodeStep = Field(default_factory=DecodeStep)
    kv_capacity_tokens: int = Field(65536, gt=0)
    # Tokens of served prefixes kept for the calls that re-send them (`fleet.replica_model.PrefixCache`);
    # unset: the KV cache's size, as vLLM's prefix caching keeps what free KV blocks hold; 0: none.
    prefix_cache_tokens: int | None = Field(None, ge=0)
    # Typical request shape, used to turn the latency model into a service rate
    # before a tier has completed anything (no history yet, no infinity either).
    typical_prompt_tokens: int = Field(200, gt=0)
    typical_output_tokens: int = Field(100, gt=0)
    # The sim engine's plain answers end of their own accord, as a model's do: each call's length is
    # drawn from a log-normal of mean typical_output_tokens and this sigma (0: always the typical
    # length), from a hash of the request, so the same request is answered at the same length.
    output_tokens_spread: float = Field(0.5, ge=0, le=3)


class CapacityProfile(_Strict):
    """What admission and scaling assume one replica of the tier does (`fleet.policy.tier_capacity`).

    Not how an engine behaves (that is `sim:` for the sim engine, and the real
    engine's own for vllm and openai): what the policy plans with. The scaler
    calibrates it at run time from what replicas measure (start-up, throughput
    when every slot is busy) and publishes the result for the gateways. Any
    field left out is taken from the tier's `sim:` profile, so a config without
    `capacity:` plans exactly as it did before the two were told apart.
    """

    startup_s: float | None = Field(None, ge=0)  # launch to serving; default: sim weights / load speed + warm-up
    prefill_tokens_per_s: float | None = Field(None, gt=0)
    decode_step: DecodeStep | None = None
    kv_capacity_tokens: int | None = Field(None, gt=0)
    typical_prompt_tokens: int | None = Field(None, gt=0)
    typical_output_tokens: int | None = Field(None, gt=0)


class VllmSettings(_Strict):
    """The `vllm` engine: what the tier passes to vLLM, as the `vllm serve` flags of the same names
    (vLLM's own parser reads them, so its defaults and checks hold). The tool-call parser, the
    reasoning parser and the chat template decide how tools, `tool_choice` and reasoning are
    served; `serve_args` passes any other `vllm serve` flag as is (e.g. `--structured-outputs-config`)."""

    model: str = ""
    tokenizer: str | None = None
    served_model_name: str = ""  # the `model` answers carry; default: `model`
    tool_call_parser: str | None = None  # e.g. hermes, llama3_json, pythonic: tool_choice auto/required/named
    enable_auto_tool_choice: bool = True  # with a parser: the model may call tools on its own (auto)
    reasoning_parser: str | None = None  # e.g. deepseek_r1, qwen3: reasoning_content in answers
    chat_template: str | None = None  # a file or the template itself; default: the tokenizer's
    serve_args: list[str] = Field(default_factory=list)
    max_num_seqs: int = Field(16, gt=0)
    max_model_len: int = Field(2048, gt=0)
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, gt=0)
    dtype: str = "auto"
    enforce_eager: bool = False
    warmup_tokens: int = Field(4, ge=0)


# Where the gateway puts the caller's Anthropic body in the chat call a Messages request runs as, for
# an `openai` engine whose upstream speaks Anthropic's API (`OpenAIUpstream.upstream_api`).
ANTHROPIC_BODY = "x_fleet_anthropic_body"


class OpenAIUpstream(_Strict):
    """Forwarding target for the `openai` engine."""

    base_url: str = "http://127.0.0.1:8001/v1"
    model: str = ""
    api_key: str = "none"
    connect_timeout_s: float = Field(5.0, gt=0)
    silence_timeout_s: float = Field(60.0, gt=0)
    # What the upstream speaks for Anthropic Messages calls: `chat` maps them to chat completions
    # (every OpenAI-compatible server), `messages` forwards them whole to its own `/messages`.
    upstream_api: Literal["chat", "messages"] = "chat"
