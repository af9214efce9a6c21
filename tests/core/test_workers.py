from specdec.models.runtime import TargetRuntime
from specdec.workers import probe_passes
from tiny import tiny_model


class FirstPassOfEachSizeIsSlow(TargetRuntime):
    """A runtime that sets up per pass size, as a CUDA model does: records each pass's size."""

    sets_up_per_shape = True

    def __init__(self, model):
        super().__init__(model)
        self.sizes = []

    def _forward(self, feeds):
        self.sizes.append(sum(len(f.tokens) for f in feeds))
        return super()._forward(feeds)


def test_a_runtime_that_sets_up_per_shape_is_probed_after_an_untimed_pass_of_each_size():
    runtime = FirstPassOfEachSizeIsSlow(tiny_model(64))
    timings = probe_passes(runtime, "verifier", (1, 2, 4))
    assert [t.tokens for t in timings] == [1, 2, 4]
    assert runtime.sizes == [2, 1, 1, 2, 2, 4, 4]  # the context, then each size twice (the second timed)


def test_a_cpu_runtime_is_probed_once_per_size():
    runtime = FirstPassOfEachSizeIsSlow(tiny_model(64))
    runtime.sets_up_per_shape = False
    probe_passes(runtime, "verifier", (1, 2, 4))
    assert runtime.sizes == [2, 1, 2, 4]
