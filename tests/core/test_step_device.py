"""The step stays on the models' device (issue 33), checked on the CPU.

On CUDA an op that mixes a device tensor with a host tensor of one dimension or more fails (a host
index into a device tensor and a host scalar are allowed). On the CPU every tensor shares one device,
so a missing `device=` passes every other test and fails the first GPU run: one did
(`_first_true_rows`' padding, found by reading). Here the runtimes report a device of their own,
`cpu:0`, and `OnDevice` follows which tensors are on it: the passes' outputs, factories and `.to`
given that device, the head's weights once moved there, and whatever an op makes from any of them.
An op that mixes them with a host tensor as CUDA would refuse fails the test; so does `.numpy()` on
a device tensor and a host generator drawing on the device.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from specdec.engine import SpecDecEngine
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.runtime import CausalLMRuntime, DraftRuntime, TargetRuntime
from specdec.params import GenerationParams
from specdec.policies import POLICY_NAMES, PolicyConfig, policy_traits
from specdec.sampling import SamplingParams
from tiny import tiny_model

DEVICE = torch.device("cpu", 0)  # "the device": a CPU device the host's tensors never report
MARK = "_on_device"


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, MARK, False)


def mark(value):
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            setattr(t, MARK, True)
    return value


def alias(t: torch.Tensor, device: bool) -> torch.Tensor:
    """A new tensor object over t's data, on the device or the host (`.to` and `.cpu` return t
    itself on the CPU, whose mark must not change)."""
    with torch._C.DisableTorchFunction():
        out = t.view_as(t)
    return mark(out) if device else out


def names_device(value) -> bool | None:
    """True: the device; False: the host; None: no device named."""
    if isinstance(value, (torch.device, str)):
        return torch.device(value) == DEVICE
    return None


class OnDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.errors: list[str] = []
        self.paused = 0

    def fail(self, func, why: str) -> None:
        here = next((f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                     for f in reversed(traceback.extract_stack()) if "/specdec/" in f.filename), "")
        self.errors.append(f"{getattr(func, '__name__', func)}: {why} ({here})")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: .device of a device tensor is the device
            out = func(*args, **kwargs)
            if on_device(args[0]):
                return DEVICE if getattr(func.__self__, "__name__", "") == "device" else mark(out)
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name == "numpy" and on_device(args[0]):
            self.fail(func, ".numpy() of a device tensor")
        if name == "cpu":
            return alias(func(*args, **kwargs), device=False)
        if name == "to":
            target = [names_device(a) for a in (*args[1:], kwargs.get("device")) if names_device(a) is not None]
            out = func(*args, **kwargs)
            return alias(out, device=target[0]) if target else (mark(out) if on_device(args[0]) else out)
        if "device" in kwargs and names_device(kwargs["device"]) is not None:  # a factory, or as_tensor(t, device=)
            if kwargs.get("generator") is not None and names_device(kwargs["device"]):
                self.fail(func, "a host generator drawing on the device")
            out = func(*args, **kwargs)
            return mark(out) if names_device(kwargs["device"]) else out
        device = [t for t in tensors if on_device(t)]
        host = [t for t in tensors if not on_device(t) and t.dim() > 0]
        if name == "__getitem__":
            if not on_device(args[0]) and device:
                self.fail(func, "a host tensor indexed by a device tensor")
            out = func(*args, **kwargs)
            return mark(out) if on_device(args[0]) else out
        if name == "__setitem__":
            value, advanced = args[2], any(isinstance(i, torch.Tensor) for i in tree_leaves(args[1]))
            if advanced and on_device(args[0]) != on_device(value) and isinstance(value, torch.Tensor) and value.dim():
                self.fail(func, "index_put across devices")
            return func(*args, **kwargs)
        if name != "copy_" and device and host:
            self.fail(func, f"device and host tensors {[tuple(t.shape) for t in host]}")
        out = func(*args, **kwargs)
        return mark(out) if device else out


@pytest.fixture
def tracked(monkeypatch):
    """The runtimes on `DEVICE`: their passes run untracked, their outputs marked; the head marked
    when its worker moves it there."""
    mode = OnDevice()
    forward, head_to = CausalLMRuntime._forward, AcceptanceHead.to

    def tracked_forward(self, feeds):
        mode.paused += 1
        try:
            outputs = forward(self, feeds)
            mark([outputs.logits, outputs.hidden])
            return outputs
        finally:
            mode.paused -= 1

    def tracked_head_to(self, *args, **kwargs):
        mode.paused += 1
        try:
            moved = head_to(self, *args, **kwargs)
        finally:
            mode.paused -= 1
        if any(names_device(a) for a in (*args, kwargs.get("device"))):
            mark(list(moved.parameters()) + list(moved.buffers()))
        return moved

    monkeypatch.setattr(CausalLMRuntime, "_forward", tracked_forward)
    monkeypatch.setattr(CausalLMRuntime, "device", property(lambda self: DEVICE))
    monkeypatch.setattr(AcceptanceHead, "to", tracked_head_to)
    return mode


SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.8, top_k=3, top_p=0.9, seed=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the models' dtype on a GPU
@pytest.mark.parametrize("kv", ["slots", "static"])
def test_every_policy_s_step_keeps_to_the_device(tracked, kv, dtype):
    target = tiny_model(6, hidden_size=16, layers=1, seed=3, init_range=0.5).to(dtype)
    draft = tiny_model(6, hidden_size=16, layers=1, seed=4, init_range=0.5).to(dtype)
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity="test")).eval()
    engine = SpecDecEngine(DraftRuntime(draft, kv=kv), TargetRuntime(target, kv=kv), head=head)
    with tracked:
        for sampling in SAMPLINGS:
            params = GenerationParams(max_new_tokens=12, chat_template=False, n=2, sampling=sampling)
            names = [name for name in POLICY_NAMES if sampling.greedy or not policy_traits(name).greedy_only]
            results = engine.generate_many(
                [[1, 2, 0], [5]] * len(names),
                [params.model_copy(update={"policy": PolicyConfig(name=name, k=3 if policy_traits(name).uses_draft else None)})
                 for name in names for _ in range(2)],
                references=[[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * 2 * len(names))
            assert [r.stats.generated_tokens for r in results] == [24] * len(results)
    assert tracked.errors == []


def test_the_check_fails_where_cuda_would(tracked):
    with tracked:
        device = torch.zeros(2, 3, device=DEVICE)
        device[torch.tensor([0])] = torch.ones(1, 3, device=DEVICE)  # allowed: a host index
        assert device.device == DEVICE and not on_device(device.cpu()) and on_device(device.cpu().to(DEVICE))
        torch.cat([device, torch.ones(1, 3)])
        device.numpy()
        torch.rand(2, generator=torch.Generator(), device=DEVICE)
    assert [e.split(":")[0] for e in tracked.errors] == ["cat", "numpy", "rand"]
