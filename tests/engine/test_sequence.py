import pytest

from kvserve.engine.sequence import Sequence
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize(("start", "end"), [(0, 3), (1, 3), (3, 5), (4, 5), (2, 5), (0, 5), (2, 4), (3, 3), (5, 5)])
def test_a_span_of_tokens_equals_the_slice_of_the_joined_lists(start: int, end: int) -> None:
    seq = Sequence("r", [10, 11, 12], SamplingParams(), seed=0, output_token_ids=[20, 21])
    assert seq.tokens(start, end) == seq.token_ids[start:end]
