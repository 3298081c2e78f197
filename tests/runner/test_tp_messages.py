"""The step message rank 0 sends the other tensor-parallel ranks rebuilds the same scheduled
step there, the state slot of each request (speculation over state layers) included."""

from unified_attn.distributed.tp_codec import decode, encode
from unified_attn.distributed.tp_messages import Mirror, Replica
from unified_attn.request import Request
from unified_attn.runner.scheduler import ScheduledRequest, SchedulerOutput
from unified_attn.sampling_params import SamplingParams


def test_a_replica_rebuilds_the_step_with_each_state_slot():
    request = Request("r", [1, 2, 3], sampling_params=SamplingParams(max_tokens=4))
    request.append_output_token_ids([4, 5])
    request.state_column = 2  # the previous verify step kept 3 tokens
    step = ScheduledRequest(request, 3, 4, ([7],), False, True, (9, 9))
    mirror, replica = Mirror(), Replica()
    rebuilt = replica.output(decode(encode(mirror.message(SchedulerOutput([step], [], [])))))
    (got,) = rebuilt.scheduled
    assert got.request.state_column == 2
    assert got.request.all_token_ids == request.all_token_ids
    assert (got.num_new_tokens, got.num_computed_before, got.spec_token_ids) == (3, 4, (9, 9))
