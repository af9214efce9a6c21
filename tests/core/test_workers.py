from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.policies import FixedK
from specdec.workers import PROBE_SIZES, VerifierWorker, probe_catch_up, probe_drafting, probe_verification
from tiny import tiny_model


class FirstPassOfEachSizeIsSlow(TargetRuntime):
    """A runtime that sets up per pass size, as a CUDA model does: records each pass's size."""

    sets_up_per_shape = True

    def __init__(self, model):
        super().__init__(model)
        self.sizes, self.outputs = [], []

    def _forward(self, feeds):
        self.sizes.append(sum(len(f.tokens) for f in feeds))
        self.outputs.append(sum(f.num_outputs for f in feeds))
        return super()._forward(feeds)


def test_a_runtime_that_sets_up_per_shape_is_probed_after_an_untimed_pass_of_each_size():
    runtime = FirstPassOfEachSizeIsSlow(tiny_model(64))
    timings = probe_verification(runtime, (1, 2, 4))
    assert [t.tokens for t in timings] == [1, 2, 4]
    assert runtime.sizes == [2, 1, 1, 2, 2, 4, 4]  # the context, then each size twice (the second timed)


def test_a_cpu_runtime_is_probed_once_per_size():
    runtime = FirstPassOfEachSizeIsSlow(tiny_model(64))
    runtime.sets_up_per_shape = False
    probe_verification(runtime, (1, 2, 4))
    assert runtime.sizes == [2, 1, 2, 4]


def test_a_verifier_probe_reads_every_token_it_feeds_as_a_verification_does():
    runtime = FirstPassOfEachSizeIsSlow(tiny_model(64))
    runtime.sets_up_per_shape = False
    probe_verification(runtime, (1, 2, 4), context=0)
    assert runtime.sizes == [1, 2, 4]
    assert runtime.outputs == [1, 2, 4]


class RecordsFeeds(DraftRuntime):
    def __init__(self, model):
        super().__init__(model)
        self.passes = []  # (sessions, tokens, outputs) of each pass

    def _forward(self, feeds):
        self.passes.append((len(feeds), sum(len(f.tokens) for f in feeds), sum(f.num_outputs for f in feeds)))
        return super()._forward(feeds)


def test_a_drafting_probe_times_a_step_of_that_many_sessions_through_the_policy():
    runtime, decided = RecordsFeeds(tiny_model(64)), []

    class Counting(FixedK):
        def decide(self, step):
            decided.append(step.index)
            return super().decide(step)

    timings = probe_drafting(runtime, (1, 3), lambda: Counting(1), context=2)
    assert [(t.role, t.tokens, t.probe) for t in timings] == [("draft", 1, True), ("draft", 3, True)]
    assert runtime.passes == [(1, 2, 1), (1, 1, 1), (3, 6, 3), (3, 3, 3)]  # untimed context, then the step
    assert decided == [1, 1, 1, 1]  # every session's candidate went through its policy


def test_a_catch_up_probe_times_one_sessions_prefill_reading_one_output():
    runtime = RecordsFeeds(tiny_model(64))
    timings = probe_catch_up(runtime, tokens=20, context=2)
    assert [(t.role, t.tokens, t.probe) for t in timings] == [("draft", 20, True)]
    assert runtime.passes == [(1, 2, 1), (1, 20, 1)]  # the untimed context, then the prefill


def test_a_worker_told_to_probe_at_its_first_batch_probes_then_and_only_then():
    """A served replica probes before its first batch, not while the other role's replica loads."""
    worker = VerifierWorker(TargetRuntime(tiny_model(64)))
    worker.probe_at_first_batch()
    assert worker.take_timings() == []
    worker.verify([])
    assert [t.tokens for t in worker.take_timings() if t.probe] == list(PROBE_SIZES["verifier"])
    worker.verify([])
    assert not any(t.probe for t in worker.take_timings())
