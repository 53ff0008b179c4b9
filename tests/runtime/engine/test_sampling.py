"""The sampler on hand-made logits: filters, penalties, seeds, and the distribution it draws from."""
import math

import pytest
import torch

from ember.runtime.engine.sampling import SamplingParams, SamplingRow, sample


def row(generator=None, prompt=(), output=(), banned=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, list(banned))


def frequencies(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    tokens, _ = sample(logits.repeat(n, 1), [row(**params) for _ in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    for params in (dict(temperature=0), dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        assert sample(logits, [row(**params) for _ in range(6)])[0] == best


def test_draws_follow_the_tempered_distribution():
    torch.manual_seed(0)
    for temperature in (1.0, 0.5):
        expected = torch.softmax(LOGITS[0] / temperature, -1)
        assert frequencies(LOGITS, 20000, temperature=temperature) == pytest.approx(expected.tolist(), abs=0.015)


def test_top_k_top_p_min_p_cut_the_tail():
    torch.manual_seed(0)
    assert frequencies(LOGITS, 20000, top_k=2) == pytest.approx([0.625, 0.375, 0, 0], abs=0.015)
    # top_p=0.7: 0.5 + 0.3 reaches it, so the third token and beyond go.
    assert frequencies(LOGITS, 20000, top_p=0.7) == pytest.approx([0.625, 0.375, 0, 0], abs=0.015)
    # min_p=0.25: tokens below 0.25 * 0.5 go.
    assert frequencies(LOGITS, 20000, min_p=0.25) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                                                                  abs=0.015)


def test_same_seed_same_draws_regardless_of_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))

    def draws(seed, neighbour_seed):
        g, other = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(neighbour_seed)
        out = []
        for _ in range(20):
            out.append(sample(logits, [row(other), row(g), row(other)])[0][1])
        return out

    assert draws(7, 1) == draws(7, 2)
    assert draws(7, 1) != draws(8, 1)


def test_banned_tokens_are_never_drawn():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert sample(logits, [row(temperature=0, banned=[0])])[0] == [1]


def test_logit_bias_adds_to_its_rows_after_the_penalties_and_a_ban_still_wins():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [row(temperature=0, logit_bias={2: 2.5}), row(temperature=0),
                                row(temperature=0, logit_bias={1: -5.0, 2: 1.5})])
    assert tokens == [2, 0, 0]   # 0 + 2.5 > 2; the row without a bias untouched; 0 + 1.5 < 2
    # after the repetition penalty (token 0 seen: 2.0 / 4 = 0.5), token 2 needs a bias over 1.0 to pass token 1
    assert sample(logits[:1], [row(temperature=0, prompt=[0], repetition_penalty=4.0, logit_bias={2: 0.6})])[0] == [1]
    assert sample(logits[:1], [row(temperature=0, prompt=[0], repetition_penalty=4.0, logit_bias={2: 1.1})])[0] == [2]
    assert sample(logits[:1], [row(temperature=0, banned=[2], logit_bias={2: 100.0})])[0] == [0]
    forced, _ = sample(logits[:1].repeat(50, 1), [row(temperature=1.0, logit_bias={1: 100.0}) for _ in range(50)])
    assert set(forced) == {1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    # Token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.5. Token 2 seen: -1.0 * 2 = -2.0 < -1.2.
    assert sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=2.0)])[0] == [1]
    neg = torch.tensor([[-1.0, -1.2]])
    assert sample(neg, [row(temperature=0, output=[0], repetition_penalty=2.0)])[0] == [1]


def test_presence_and_frequency_penalties_count_output_tokens():
    logits = torch.tensor([[1.0, 0.5]])
    assert sample(logits, [row(temperature=0, output=[0], presence_penalty=0.6)])[0] == [1]
    assert sample(logits, [row(temperature=0, output=[0], presence_penalty=0.4)])[0] == [0]
    # frequency: 0.2 per occurrence; 3 occurrences take 0.6 > 0.5.
    assert sample(logits, [row(temperature=0, output=[0, 0, 0], frequency_penalty=0.2)])[0] == [1]
    assert sample(logits, [row(temperature=0, output=[0, 0], frequency_penalty=0.2)])[0] == [0]
    # Prompt tokens do not count for presence/frequency.
    assert sample(logits, [row(temperature=0, prompt=[0, 0, 0], frequency_penalty=0.2)])[0] == [0]


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    tokens, logprobs = sample(logits, [row(temperature=0, logprobs=2, repetition_penalty=1.5, prompt=[0]),
                                       row(temperature=0)])
    expected = torch.log_softmax(logits[0], -1)
    assert logprobs[1] is None
    assert logprobs[0]["token_id"] == tokens[0] == 0
    assert logprobs[0]["logprob"] == pytest.approx(expected[0].item())
    assert [t for t, _ in logprobs[0]["top"]] == [0, 1]
    assert logprobs[0]["top"][1][1] == pytest.approx(expected[1].item())
    assert sum(math.exp(v) for v in expected.tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_k", -1), ("top_p", 1.5), ("min_p", 2.0), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("logprobs", 50), ("max_tokens", 0),
    ("logit_bias", {100: 1.0}), ("logit_bias", {5: 100.5}), ("logit_bias", {5: float("nan")}),
    ("logit_bias", {t: 1.0 for t in range(301)}),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(vocab_size=100)
