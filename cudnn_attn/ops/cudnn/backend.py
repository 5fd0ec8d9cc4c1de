"""The cuDNN backend: problems lowered to cuDNN execution plans through the frontend.

Build: lower, validate, build the operation graph, create plans from the heuristics, check
support, build; or load the plan from the persistent store, and save what was built there.
One handle serves all of it: the library's own for the thread (the frontend would make a
default handle of its own beside it for any graph given none).
cuDNN's own failures are re-raised as ``UnsupportedError`` naming the problem, the GPU and
the versions. Running a plan is ``plan.py``'s business; where cuDNN runs,
``platform.py``'s.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import torch

from ...core.problem import AttentionProblem
from ...errors import UnsupportedError
from ...plan_store import PlanStore, choice_problems, entry_key, signature
from . import autotune as autotune_
from . import capabilities, lowering
from . import platform as cudnn_platform
from .frontend_internals import selected_plan_name
from .lowering import Lowered
from .plan import CudnnPlan
from .platform import cudnn_handle, platform, stream_pointer

log = logging.getLogger("cudnn_attn.cudnn")


class CudnnBackend:
    name = "cudnn"
    tunable = True
    stores_plans = True

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        if not problem.device.startswith("cuda"):
            return [f"device={problem.device}: cuDNN runs on CUDA tensors"]
        if not torch.cuda.is_available():
            return ["no CUDA device is available"]
        try:
            here = platform(cudnn_platform.device_index(problem.device))
        except ModuleNotFoundError as error:  # a CPU install: the frontend comes with the GPU extras
            return [
                f"nvidia-cudnn-frontend is not installed ({error}); on a GPU machine install "
                'cudnn-attn with the extra of your torch\'s CUDA: pip install "cudnn-attn[cu12]" or "[cu13]"'
            ]
        except Exception as error:  # the frontend is there but libcudnn is missing or unloadable
            return [f"the cuDNN library cannot be loaded: {str(error).splitlines()[0]}"]
        return capabilities.unsupported_reasons(problem, here)

    def plan_key(self, problem: AttentionProblem) -> tuple:
        here = platform(cudnn_platform.device_index(problem.device))
        return (here.arch, here.cudnn, here.frontend)

    def build(
        self,
        problem: AttentionProblem,
        *,
        autotune: bool = False,
        store: PlanStore | None = None,
        rng_dump: bool = False,
    ) -> CudnnPlan:
        """Load the plan from ``store`` when it holds one for this problem and platform (a tuned
        plan serves a request without tuning too: it is the better one); otherwise build it
        (timing every candidate when ``autotune``) and save it there."""
        device_index = cudnn_platform.device_index(problem.device)
        here = platform(device_index)
        record = {
            "gpu": here.gpu,
            "arch": list(here.arch),
            "cudnn": here.cudnn,
            "frontend": here.frontend,
            "graph": lowering.GRAPH_REVISION,  # a stored plan is of the graph this library builds
        }
        variant = "autotuned" if autotune else "heuristic"
        key = entry_key(problem, record, variant) if store is not None and not rng_dump else None
        try:
            if key is not None and store is not None:
                loadable = [key] if autotune else [entry_key(problem, record, "autotuned"), key]
                for stored in loadable:
                    plan = self._load(problem, store, stored, record, device_index)
                    if plan is not None:
                        return plan
            # One handle for lowering, planning and tuning: the library's own for this thread.
            lowered = lowering.lower(problem, rng_dump=rng_dump, handle=cudnn_handle(device_index))
            plan = self._build(problem, lowered, autotune, device_index)
        except (UnsupportedError, torch.OutOfMemoryError):
            raise  # torch's out-of-memory error passes unchanged: what torch users catch and retry on
        except Exception as error:  # cuDNN's own failures: re-raised with the problem and the machine
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if autotune_.is_out_of_memory(error):  # cuDNN's failed allocation, as torch would say it
                raise torch.OutOfMemoryError(
                    f"{problem.describe()} on {here.describe()}: cuDNN ran out of GPU memory building "
                    f"its plan ({first}); nothing was cached or stored, and the next call builds afresh"
                ) from error
            raise UnsupportedError(
                [f"cuDNN could not build a plan: {first}"],
                context=f"{problem.describe()} on {here.describe()}",
                alternatives=['backend="reference" runs every valid problem'],
            ) from error
        if key is not None and store is not None:
            self._save(plan, store, key, record, variant)
        return plan

    def _build(self, problem: AttentionProblem, lowered: Lowered, autotune: bool, device_index: int) -> CudnnPlan:
        graph = _planned(lowered.graph)
        with torch.cuda.device(device_index):
            if autotune:
                from ...core import synthetic  # tuning only: not imported on the way to a stored plan

                probe = CudnnPlan(problem, lowered, 0, device_index)
                inputs, outputs = synthetic.run_tensors(problem)
                handle = cudnn_handle(device_index)
                self._cudnn_module().set_stream(handle, stream_pointer(None, device_index))
                choice = autotune_.tune(
                    graph, probe.variant_pack(inputs, outputs), handle, probe.device, problem.describe()
                )
                # The tuned graph holds every candidate it built: run the winner from a fresh
                # graph that builds it alone, as the heuristic path would.
                lowered = lowering.lower(problem, rng_dump=lowered.rng_dump, handle=handle)
                graph = _planned(lowered.graph)
                graph.select_plan(choice.index)
                graph.build_plans()
            else:
                graph.build_plans()
                choice = autotune_.Choice(index=-1, name=selected_plan_name(graph))
        plan = CudnnPlan(problem, lowered, int(graph.get_workspace_size()), device_index)
        plan.choice, plan.source = choice, "built"
        # Planning leaves reference cycles in the frontend that hold its dead frames, and through
        # their callers every tensor of the call that asked for the plan (a packed backward's
        # inputs and gradients: gigabytes) until the cyclic collector runs. Collected here, once
        # per plan built, while those frames are already unreachable.
        gc.collect()
        return plan

    @staticmethod
    def _cudnn_module() -> Any:
        import cudnn

        return cudnn

    def _load(self, problem, store, key, record, device_index) -> CudnnPlan | None:
        """The stored plan, deserialized into an empty graph: nothing is validated, lowered to
        cuDNN or planned (the lowering below only records what running the plan binds).

        None (with a warning) for an entry that cannot be used, its header's fields included (a
        file another version wrote): the build that asked rebuilds the plan and overwrites it.
        """
        entry = store.load(key, record)
        if entry is None:
            return None
        try:
            choice = _stored_choice(entry.header)  # first: a header of another layout is not deserialized
            plan = self.from_blob(problem, entry.blob, device_index)
        except Exception as error:  # a plan this cuDNN cannot load: rebuild and overwrite it
            if autotune_.is_out_of_memory(error):
                raise  # the plan is fine, the GPU is full: rebuilding would overwrite a good file
            log.warning(
                "plan store: cannot load %s (%s); rebuilding",
                key[:12],
                str(error).splitlines()[0] if str(error) else error,
            )
            return None
        plan.choice = choice
        plan.source = "disk"
        return plan

    def from_blob(self, problem: AttentionProblem, blob: bytes, device_index: int | None = None) -> CudnnPlan:
        """A plan serialized by ``to_blob``, deserialized into an empty graph: nothing validated,
        lowered to cuDNN or planned (the lowering only records what running the plan binds)."""
        import cudnn

        if device_index is None:
            device_index = cudnn_platform.device_index(problem.device)
        lowered = lowering.lower(problem)
        handle = cudnn_handle(device_index)
        graph = cudnn.pygraph(handle=handle)  # the frontend would otherwise make a default handle of its own
        graph.deserialize(handle, blob)
        plan = CudnnPlan(
            problem, dataclasses.replace(lowered, graph=graph), int(graph.get_workspace_size()), device_index
        )
        plan.source = "disk"
        return plan

    def to_blob(self, plan: Any) -> bytes:
        return bytes(plan.graph.serialize(as_bytes=True))

    def _save(self, plan: CudnnPlan, store: PlanStore, key: str, record: dict, variant: str) -> None:
        try:
            blob = self.to_blob(plan)
        except Exception as error:  # some plans cannot be serialized: they are simply not stored
            log.info(
                "plan store: %s not serializable (%s)",
                plan.problem.describe(),
                str(error).splitlines()[0] if str(error) else error,
            )
            return
        header = {
            "problem": signature(plan.problem),
            "platform": record,
            "variant": variant,
            "choice": plan.choice.as_record(),
            "describe": plan.problem.describe(),
        }
        store.save(key, header, blob)


def _stored_choice(header: dict[str, Any]) -> autotune_.Choice:
    """The choice a stored plan's header records; ValueError naming what is wrong with it."""
    problems = choice_problems(header)
    if problems:
        raise ValueError(f"header of another layout: {', '.join(problems)}")
    fields = autotune_.Choice.__dataclass_fields__
    return autotune_.Choice(**{k: v for k, v in header["choice"].items() if k in fields})


def _planned(graph: Any) -> Any:
    """Validate a lowered graph and rank its candidate plans (nothing built yet)."""
    import cudnn

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    return graph
