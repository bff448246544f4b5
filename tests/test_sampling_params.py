"""SamplingParams validation: tiny temperatures are greedy, stop strings and stop token ids are checked."""

import math

import pytest
import torch

from spruce.errors import InvalidRequestError
from spruce.runtime.sampler import SamplingTensors, select_tokens, target_probs
from spruce.sampling_params import MAX_STOP_TOKEN_IDS, SAMPLING_EPS, SamplingParams

LOGITS = torch.tensor([[2.0, 1.5, 3.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-10, 9.9e-6])
def test_temperature_below_eps_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.greedy


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-4, 0.7])
def test_temperature_from_eps_up_samples(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == temperature and not params.greedy


def test_eps_temperature_gives_finite_probabilities_on_the_argmax():
    """At the threshold the sampler's distribution is finite and (these logits being far apart) the argmax."""
    params = SamplingParams(temperature=SAMPLING_EPS, seed=0)
    st = SamplingTensors.build([params], [0], LOGITS.shape[1], "cpu")
    probs = target_probs(LOGITS, st)[0]
    assert torch.isfinite(probs).all() and math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)
    assert probs.argmax().item() == 2 and probs[2].item() == pytest.approx(1.0)
    tokens = select_tokens(LOGITS.expand(16, -1), SamplingTensors.build([params] * 16, [0] * 16, 8, "cpu"),
                           torch.arange(16))
    assert tokens.tolist() == [2] * 16


def test_tiny_temperature_matches_greedy_tokens():
    """1e-39 used to reach the sampler, where logits / 1e-39 is inf and the NaN softmax picked token 0."""
    greedy = SamplingTensors.build([SamplingParams(temperature=0.0)], [0], 8, "cpu")
    tiny = SamplingTensors.build([SamplingParams(temperature=1e-39, seed=0)], [0], 8, "cpu")
    positions = torch.arange(1)
    assert select_tokens(LOGITS, tiny, positions).tolist() == select_tokens(LOGITS, greedy, positions).tolist() == [2]


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""]])
def test_empty_stop_strings_are_refused(stop):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=stop)
    assert e.value.field == "stop"


@pytest.mark.parametrize("ids", [[-1], [3, -7], list(range(MAX_STOP_TOKEN_IDS + 1)), [1.5], [True]])
def test_bad_stop_token_ids_are_refused(ids):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=ids)
    assert e.value.field == "stop_token_ids"


def test_stop_token_ids_up_to_the_cap_are_accepted():
    assert len(SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids) == MAX_STOP_TOKEN_IDS
