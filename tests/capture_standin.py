"""A CPU stand-in for the CUDA graphs that `StepRunner` captures (`rollout/engine/step.py`), for the tests of the
captured static steps (tests/test_static_step.py, tests/test_speculative.py).

A CUDA graph records the kernels one run of the step launches, with their arguments: every Python value the step
read while it was captured (a host integer it sliced by, a float, a branch it took) is frozen into it, and a replay
reads and writes the memory at the addresses the capture saw, whatever tensors the Python holds now. The stand-in
does the same on the CPU: the capture traces the step (`make_fx`), so that the Python values read during the trace
become constants of the traced graph, and each replay runs that graph on the tensors found at the captured
addresses among those the runner holds (the tensors of its key) and the fixed ones (the weights). A step that reads
a host value per step replays what it read at the capture, not what it reads now (a value it reads back from a tensor
it computed, `.item()`, is refused by the trace, as by a capture); a step that reads a tensor outside its key is
refused at the capture; a replay whose tensors moved fails, as a real graph would read freed memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sparserl.rollout.engine import step as step_module


def _storages(value) -> list[int]:
    return [leaf.untyped_storage().data_ptr() for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _address(tensor: torch.Tensor) -> tuple:
    """Where a graph finds a tensor: its address, and how it reads from there."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


class StepAccess(TorchDispatchMode):
    """The storages a step reads that it did not make itself (`inputs`: weights, buffers, state) and, of those, the ones
    it writes in place (`written`). It holds a tensor of every storage it sees until it is dropped, so that no storage
    the step freed is reused by another tensor while the access is studied."""

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.inputs: set[int] = set()
        self.written: set[int] = set()
        self._seen: dict[int, tuple[torch.Tensor, object]] = {}  # storage -> a tensor on it, the first op reading it

    def described(self, storage: int) -> str:
        """The tensor on `storage`, as an error names it."""
        tensor, func = self._seen[storage]
        return f"{tensor.dtype} {list(tensor.shape)} read by {func}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._seen.setdefault(leaf.untyped_storage().data_ptr(), (leaf, func))
        self.inputs.update(ptr for ptr in _storages((args, kwargs)) if ptr not in self.made)
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                self.written.update(ptr for ptr in _storages(value) if ptr in self.inputs)
        out = func(*args, **kwargs)
        self.made.update(ptr for ptr in _storages(out) if ptr not in self.inputs)
        return out


@contextlib.contextmanager
def restored(state: list[torch.Tensor]):
    """`state` as it was before the block: a capture's warm-up takes a real step, whose effects the capture undoes."""
    saved = [(tensor, tensor.clone()) for tensor in state]
    yield
    for tensor, copy in saved:
        tensor.copy_(copy)


class TracedGraph:
    """One captured step: `replay()` runs the traced graph on the tensors now at the captured addresses.

    `held()`: the tensors the runner holds now (the buffers and state of its key); `fixed`: what every step reads
    and none writes (weights, rotary frequencies)."""

    def __init__(self, step: Callable[[], None], state: list[torch.Tensor], held: Callable[[], list[torch.Tensor]],
                 fixed: list[torch.Tensor]):
        self.held, self.fixed = held, fixed
        keyed = [*held(), *fixed]
        with restored(state), StepAccess() as access:
            step()  # the warm-up, which also tells what the step reads from outside and writes
        keyed_storages, fixed_storages = set(_storages(held())), set(_storages(fixed))
        assert access.written <= keyed_storages, "the warm-up wrote a tensor the runner neither restores nor holds"
        outside = [access.described(ptr) for ptr in access.inputs - keyed_storages - fixed_storages]
        assert not outside, (f"the step reads tensors that are not in its key ({', '.join(sorted(outside))}): a graph "
                             f"would replay over whatever their addresses hold after they are replaced")
        # The trace notes each value's shape in a fake tensor of a fake mode it makes per operation unless it finds one
        # (most of its time): one for the whole trace.
        with restored(state), tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
            self.graph = make_fx(step)()  # runs the step once more, recording it; the first replay takes the step
        self.addresses = self._inputs_by_address({_address(t) for t in keyed})
        frozen = set(_storages([*self.graph.parameters(), *self.graph.buffers()]))  # what stayed a constant
        assert not frozen & access.inputs, "the step reads a view of its tensors that the runner does not hold"

    def _inputs_by_address(self, keyed: set[tuple]) -> list[tuple]:
        """Turn each tensor the trace froze in as a constant and that the runner holds into an input of the graph,
        found by its address at each replay; a tensor the step made for itself during the trace stays a constant."""
        graph = self.graph.graph
        targets = list(dict.fromkeys(  # a constant the trace reads in several places is one input
            node.target for node in graph.nodes if node.op == "get_attr"
            and isinstance(tensor := getattr(self.graph, node.target), torch.Tensor) and _address(tensor) in keyed))
        with graph.inserting_before(next(iter(graph.nodes))):  # each after the one before, ahead of every node
            placeholders = {target: graph.placeholder(f"held_{i}") for i, target in enumerate(targets)}
        for node in [n for n in graph.nodes if n.op == "get_attr" and n.target in placeholders]:
            node.replace_all_uses_with(placeholders[node.target])
            graph.erase_node(node)
        addresses = [_address(getattr(self.graph, target)) for target in targets]
        for target in targets:
            delattr(self.graph, target)
        self.graph.recompile()
        return addresses

    def replay(self) -> None:
        now = {_address(t): t for t in [*self.held(), *self.fixed]}
        missing = [address for address in self.addresses if address not in now]
        assert not missing, (f"a replay of a stale graph: {len(missing)} tensor(s) it captured are no longer at their "
                             f"addresses (a CUDA graph would read freed memory)")
        self.graph(*(now[address] for address in self.addresses))


@contextlib.contextmanager
def traced_graphs(monkeypatch, fixed: Iterable[torch.Tensor]):
    """`StepRunner`'s captures made `TracedGraph`s on the CPU while the block runs; yields the graphs captured and the
    (step, key, addresses) each call to the runner met. `fixed`: the tensors every step reads and none writes (the
    models' parameters and buffers)."""
    graphs: list[TracedGraph] = []
    met: list[tuple] = []
    held: list[torch.Tensor] = []
    replay = step_module.StepRunner._replay
    fixed = list(fixed)

    def tracked_replay(self, run, args, buffers, state, key):
        held[:] = [*buffers, *(t for t in state if t is not None)]
        met.append((run, key, tuple((t.data_ptr(), tuple(t.shape)) for t in held)))
        return replay(self, run, args, buffers, state, key)

    def capture(run, state):
        graphs.append(TracedGraph(run, state, lambda: held, fixed))
        return graphs[-1]

    monkeypatch.setattr(step_module.StepRunner, "_replay", tracked_replay)
    monkeypatch.setattr(step_module, "_capture", capture)
    yield graphs, met


def model_tensors(*models: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of `models`: what a step reads and never writes."""
    return [t for model in models for t in (*model.parameters(), *model.buffers())]
