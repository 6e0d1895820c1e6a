"""Which trainable parameters of models prepared by ``wgrad.install`` get their gradient
in W (deferred) and which in B — for users checking what the split backward covers."""
from __future__ import annotations

import dataclasses

import torch

from .megatron_linear import deferred_parameters


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WgradCoverage:
    """Which trainable parameters of the installed models get their gradient in W."""

    deferred: tuple[str, ...]
    """Weights of installed megatron linears and Transformer Engine modules: gradient computed by ``run`` (W)."""
    in_backward: tuple[tuple[str, str], ...]
    """(parameter, owning module type) computed by autograd in B: biases, norms,
    embeddings, other modules. Tied weights used by a linear too are listed here and
    get that linear's part in W."""

    def summary(self) -> str:
        lines = [f"deferred to W ({len(self.deferred)}):"] + [f"  {n}" for n in self.deferred]
        lines += [f"computed in B ({len(self.in_backward)}):"] + [f"  {n} [{t}]" for n, t in self.in_backward]
        return "\n".join(lines)


def coverage(models: list[torch.nn.Module]) -> WgradCoverage:
    deferred_ids = {id(p) for p in deferred_parameters(models)}
    deferred, in_backward, seen = [], [], set()
    for index, model in enumerate(models):
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                name = f"model[{index}].{module_name}.{param_name}".replace("..", ".")
                if id(param) in deferred_ids:
                    deferred.append(name)
                else:
                    in_backward.append((name, type(module).__name__))
    return WgradCoverage(deferred=tuple(deferred), in_backward=tuple(in_backward))


__all__ = ["WgradCoverage", "coverage"]
