"""What this machine decides for a run, once, before the policy's weights load: `resolve_settings`.

A config leaves some settings to the engine: model.device and memory.precision ("auto"), the memory settings
(memory.micro_batch_tokens = 0, memory.logprob_chunk_size = 0, memory.activation_checkpointing = auto:
plan/device_defaults.py), memory.cpu_update_mmap, rollout.cuda_graphs and lora.quant_backend (auto), and with a warm
start the model GRPO starts from (run_dir/base or run_dir/sft). They are decided here, in one place, into a frozen
`Resolved`; every later stage reads it and nothing writes the config (its dataclasses are frozen).

Three `auto`s need something this step does not have, and take the rest of their answer where it is known:
rollout.cuda_graphs is "off" here wherever no chunk can be captured (a CPU, FSDP2 planned), and otherwise the
first rollout also reads the model itself (rollout/static_decode.py graphs_for: a longrope model or FSDP units
decode eagerly); tools.format=auto asks the tokenizer's chat template (collect/tool_groups.py), loaded after this;
distributed.backend and distributed.strategy are needed when the process group is joined (train/distributed.py
init_world), before anything is read: the run joins with the answers of the functions Resolved records them by
(policy_spec.collective_backend, policy_spec.sharding).

A checkpoint stores it as resolved.yaml (`Resolved.to_yaml`): its `config` is the config the run trained with
(the one config.yaml holds), and `machine` says what this machine decided.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..config import Config
from ..config.load import as_mapping
from ..model.nf4 import choose_nf4_backend
from ..rollout.static_decode import cuda_graphs_on
from .device_defaults import MemoryChoice, update_mmap_choice
from .from_config import config_memory_choice, config_model_shape, precision_choice, static_decode_planned
from .memory import param_counts
from .policy_spec import collective_backend, sharding

RESOLVED_FILE = "resolved.yaml"


@dataclass(frozen=True)
class Resolved:
    """The settings a run trains with on this machine."""

    config: Config  # the user's config with the engine's choices written in (memory.*, model.path)
    device: torch.device  # where the policy trains (model.device resolved)
    precision: str  # the weights' dtype, memory.precision resolved for `device` (fp32 | bf16)
    card_gib: float | None = None  # the card the memory settings were chosen for; None on a CPU
    planned_gib: float | None = None  # the memory planner's peak for them on that card; None on a CPU
    precision_why: str = ""  # why `precision` (plan/precision.py PrecisionChoice.why)
    strategy: str = "none"  # data parallelism over torchrun's ranks (policy_spec.sharding): none | ddp | fsdp2
    backend: str = "gloo"  # the ranks' collectives (policy_spec.collective_backend): gloo | nccl

    def machine(self) -> dict:
        """What this machine decided, beside the config, as plain YAML values."""
        return {"device": str(self.device), "precision": self.precision, "precision_why": self.precision_why,
                "card_gib": self.card_gib, "planned_gib": self.planned_gib}

    def to_yaml(self) -> str:
        """resolved.yaml: `machine` (what was decided here) and `config` (the config the run trains with)."""
        return yaml.safe_dump({"machine": self.machine(), "config": as_mapping(self.config)}, sort_keys=False)


def resolve_settings(cfg: Config, device: torch.device, kept_precision: str | None = None) -> Resolved:
    """`cfg` as it runs on `device`: the memory settings left to the engine chosen for this device's card (or the
    CPU defaults), memory.precision resolved (`kept_precision`: a resumed run's, kept), and model.path the warm
    start's output. Reads at most the model's config.json or GGUF header (the shape the card's memory plan and a
    CPU's precision need), never its weights. The chosen precision is written into the config's memory.precision."""
    precision = precision_choice(cfg, device, kept_precision)
    card = card_gib(cfg, device)
    asked = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, precision=precision.precision))
    choice = config_memory_choice(asked, card)  # in the precision chosen: what the step will hold
    config = dataclasses.replace(asked, memory=chosen_memory(asked, choice),
                                 model=dataclasses.replace(cfg.model, path=warm_start_path(cfg)),
                                 rollout=dataclasses.replace(cfg.rollout, cuda_graphs=decode_graphs(asked, device)),
                                 lora=dataclasses.replace(cfg.lora, quant_backend=nf4_backend(cfg, device)))
    strategy = sharding(asked, lambda: param_counts(config_model_shape(cfg))[0])
    return Resolved(config, device, precision.precision, card, choice.planned_gib, precision.why, strategy,
                    collective_backend(cfg.distributed.backend, device))


def chosen_memory(cfg: Config, choice: MemoryChoice):
    """cfg.memory with the choice's values in place of the ones left to the engine."""
    return dataclasses.replace(cfg.memory, micro_batch_tokens=choice.micro_batch_tokens,
                               logprob_chunk_size=choice.logprob_chunk_size,
                               activation_checkpointing=choice.activation_checkpointing,
                               checkpoint_every=choice.checkpoint_every,
                               cpu_update_mmap=update_mmap_choice(cfg.memory.cpu_update_mmap))


def decode_graphs(cfg: Config, device: torch.device) -> str:
    """rollout.cuda_graphs as the run decodes on `device`: "off" where no chunk will be captured (not CUDA:
    static_decode.cuda_graphs_on, which refuses `on` there; `auto` with FSDP2 planned: static_decode_planned), else
    as written (`auto` keeps its eager fallback after a failed capture check)."""
    graphs = cfg.rollout.cuda_graphs
    return graphs if cuda_graphs_on(graphs, device) and static_decode_planned(cfg) else "off"


def nf4_backend(cfg: Config, device: torch.device) -> str:
    """lora.quant_backend as the run quantizes: for an NF4 base the backend model/nf4.py choose_nf4_backend finds
    on `device`; as written when nothing is quantized or none can run (the model's loading warns, or refuses under
    lora.strict, naming why)."""
    if not (cfg.lora.enabled and cfg.lora.quantize_base == "nf4"):
        return cfg.lora.quant_backend
    backend, _ = choose_nf4_backend(cfg.lora, device)
    return backend or cfg.lora.quant_backend


def card_gib(cfg: Config, device: torch.device) -> float | None:
    """The card the memory settings are chosen for: memory.gpu_memory_gib, else the CUDA device's own memory;
    None on a CPU."""
    if device.type != "cuda":
        return None
    return cfg.memory.gpu_memory_gib or torch.cuda.get_device_properties(device).total_memory / 2**30


def warm_start_path(cfg: Config) -> str:
    """The model GRPO starts from: the warm start's last stage (sft/warm_start.py writes run_dir/base for a tiny
    random model, run_dir/sft after a supervised phase), else model.path."""
    if cfg.warm_start.sft.steps > 0:
        return str(Path(cfg.run_dir) / "sft")
    if cfg.warm_start.tiny.arch:
        return str(Path(cfg.run_dir) / "base")
    return cfg.model.path
