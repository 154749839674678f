"""DeepSpeed's mixture of experts (deepspeed.moe.layer.MoE, expert parallelism, ZeRO-1/2) under the adapter:
what differs from a dense engine.

- Expert-parallel rank e holds experts [e*L, (e+1)*L) of each MoE layer (L local experts), named by their
  local index in the module (`...deepspeed_experts.<local>.`). Shard-map keys name an expert by its global
  id instead (`...deepspeed_experts.<global>.`, as DeepSpeed's own `layer_*_expert_*` files do), for weights
  and optimizer state alike, so a snapshot reshards to another expert-parallel size by those keys
  (reshard.load, with this class naming the keys). Non-expert parameters keep their module names.
- ZeRO-1/2 put the experts in param groups of their own, partitioned over the expert-data-parallel group
  (the ranks holding the same experts) rather than the whole data-parallel group: each group's fp32 master
  and moments are mapped with the rank's index in that group's own partitioning (partition_ranks), so the
  expert-data-parallel replicas split their experts' optimizer state as data-parallel replicas split the
  rest.
- save_checkpoint writes the expert weights as `layer_<moe layer>_expert_<global id>` files, on expert-data-
  parallel rank 0. A snapshot keeps none of them: under ZeRO-1/2 the weights are their fp32 masters, rounded
  to the training dtype after every step, so a restore serves DeepSpeed the live expert weights for those
  files and then sets every weight from its restored master (restored()), as the optimizer's step does.
- DeepSpeed hands over the non-expert model states on data-parallel rank 0 only; for a snapshot every
  replica hands them over (every_replica_saves) and stores 1/DP of them, as for a dense engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

from ...errors import ConfigError
from ...snapshot.annotate import OPTIMIZER_STATE, optimizer_key
from . import shards, tensor_parallel

_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$")


@dataclasses.dataclass(frozen=True)
class _Layer:
    prefix: str  # `<module name>.deepspeed_moe.experts.deepspeed_experts.`
    first: int  # the global id of this rank's local expert 0
    local: int  # experts per expert-parallel rank


class Experts:
    def __init__(self, engine):
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import groups

        self.engine, layers = engine, []
        for name, module in engine.module.named_modules():
            if isinstance(module, MoE):  # all of one expert-parallel size (check_supported)
                self.ep, self.ep_rank = module.ep_size, groups._get_expert_parallel_rank(module.expert_group_name)
                layers.append(_Layer(f"{name}{_EXPERTS}", self.ep_rank * module.num_local_experts,
                                     module.num_local_experts))
        self._layers = tuple(layers)

    # ---- keys ---------------------------------------------------------------------------------------------
    def _split(self, name: str):
        """(layer, expert index, rest) of an expert parameter's name, or None."""
        for layer in self._layers:
            if name.startswith(layer.prefix):
                idx, _, rest = name[len(layer.prefix):].partition(".")
                return layer, int(idx), rest
        return None

    def key_of(self, name: str) -> str:
        """A module parameter name -> its shard-map key: a local expert index becomes the global id."""
        found = self._split(name)
        if found is None:
            return name
        layer, local, rest = found
        return f"{layer.prefix}{layer.first + local}.{rest}"

    def held_elsewhere(self, key: str) -> bool:
        """Whether a shard-map key names an expert another expert-parallel rank holds."""
        found = self._split(key)
        return found is not None and not found[0].first <= found[1] < found[0].first + found[0].local

    def rekey(self, tree):
        """Re-key, in place, the optimizer-state specs in `tree` (shards.with_specs' output, whose Sharded
        wrappers are its own) from local expert names to global ones."""
        return shards.rekey_specs(tree, self._rekeyed)

    def _rekeyed(self, spec):
        if not spec.key.startswith(OPTIMIZER_STATE):
            return spec
        kind, name = spec.key[len(OPTIMIZER_STATE):].split(".", 1)
        return dataclasses.replace(spec, key=optimizer_key(kind, self.key_of(name)))

    # ---- saving -------------------------------------------------------------------------------------------
    def partition_ranks(self) -> list[int]:
        """This rank's partition index in each ZeRO-1/2 param group (expert groups: in the expert-data-parallel
        group)."""
        import deepspeed.comm as dist

        return [dist.get_rank(group=g) for g in self.engine.optimizer.real_dp_process_group]

    @staticmethod
    def without_expert_files(files: dict) -> dict:
        """DeepSpeed's files minus its expert weight files: the fp32 masters stand for them."""
        return {n: sd for n, sd in files.items() if not _EXPERT_FILE.match(n)}

    @staticmethod
    @contextlib.contextmanager
    def every_replica_saves():
        """While a snapshot is taken: save_checkpoint builds the non-expert model states on every data-parallel
        replica (it asks `groups._get_data_parallel_rank() == 0` for that, and for nothing else a native MoE
        layer's save reads)."""
        from deepspeed.utils import groups

        asked = groups._get_data_parallel_rank
        groups._get_data_parallel_rank = lambda: 0
        try:
            yield
        finally:
            groups._get_data_parallel_rank = asked

    # ---- restoring ----------------------------------------------------------------------------------------
    def expert_files(self, tag: str) -> dict[str, dict]:
        """The expert files DeepSpeed's load asks for (file name -> state dict, keyed by global id), holding the
        live weights: restored() replaces them by the restored masters."""
        from deepspeed import DeepSpeedEngine

        module, out = self.engine.module, {}
        params = dict(module.named_parameters())
        for moe_layer, layer in enumerate(self._layers):
            for local in range(layer.local):
                sd = {self.key_of(n): p.detach() for n, p in params.items()
                      if n.startswith(f"{layer.prefix}{local}.")}
                path = DeepSpeedEngine._get_expert_ckpt_name("", moe_layer, layer.first + local, tag,
                                                             checkpoint_mp_rank=self.engine.checkpoint_mp_rank)
                out[path.rsplit("/", 1)[-1]] = sd
        return out

    def restored(self) -> None:
        """After DeepSpeed loaded the snapshot (collective): every weight from its fp32 master."""
        self.engine.optimizer.update_lp_params()


def check_supported(engine, without: str) -> None:
    """MoE layouts the adapter captures: native MoE layers of one expert-parallel size, ZeRO-1/2, no pipeline,
    no expert tensor parallelism; raises ConfigError naming what is not (and `without`: going on without us)."""
    problem = _problem(engine)
    if problem:
        raise ConfigError(f"inmem_ft: {problem}, or {without}")


def _problem(engine) -> str | None:
    from deepspeed.moe.layer import MoE

    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2):
        return (f"mixture-of-experts layers are supported with ZeRO-1 and ZeRO-2, this engine runs ZeRO-{stage}; set "
                f"zero_optimization.stage to 1 or 2")
    if getattr(engine, "pipeline_parallelism", False):
        return "mixture-of-experts layers inside a PipelineModule are not supported; train without pipeline stages"
    moe = [m for m in engine.module.modules() if isinstance(m, MoE)]
    if len(moe) != len(engine.num_experts):
        return "only deepspeed.moe.layer.MoE layers are supported, not AutoEP's (expert_parallel) replacement layers"
    if len({m.ep_size for m in moe}) > 1:
        return f"MoE layers of different expert-parallel sizes ({sorted({m.ep_size for m in moe})}) are not supported"
    if tensor_parallel.size_of(engine) > 1:  # the slices' boxes are keyed by module name, not by global expert
        return "mixture-of-experts layers together with tensor parallelism (an mpu) are not supported"
    if any(m.enable_expert_tensor_parallelism for m in moe):
        return "MoE layers with enable_expert_tensor_parallelism are not supported"
    buffers = [n for m in moe for n, _ in m.deepspeed_moe.experts.named_buffers()]
    if buffers:
        return (f"MoE experts with buffers ({buffers[0]}) are not supported: a snapshot rebuilds expert weights from "
                f"their fp32 masters, which buffers have none of")
    return None
