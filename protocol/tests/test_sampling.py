"""The specified sampler against a literal reading of its definition, and its check against
honest machines whose logits differ from the verifier's."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from protocol.sampling import (
    LIKELY,
    MATCH,
    MISS,
    TIE_GAP,
    UNCERTAIN,
    part_mass,
    part_of_draw,
    select,
    select_masked,
    token_check,
    uniform,
)


def reference_select(logits: np.ndarray, *, temperature: float, top_p: float, u: float) -> int:
    """The module docstring's rule, read literally: float64, a full sort, a full cumulative sum."""
    x = logits.astype(np.float64)
    if temperature <= 0:
        return int(np.argmax(x))
    w = np.exp((x - x.max()) / temperature)
    kept = list(range(len(w)))
    if top_p < 1:
        ranked = sorted(kept, key=lambda i: (-w[i], i))
        goal, reached, kept = top_p * w.sum(), 0.0, []
        for i in ranked:
            kept.append(i)
            reached += w[i]
            if reached >= goal:
                break
        kept.sort()
    cumulative = np.cumsum(w[kept])
    return kept[int(np.argmax(cumulative > u * cumulative[-1]))]


def logits_like_a_model(rng: np.random.Generator, size: int) -> np.ndarray:
    """Logits with a few likely tokens over a long tail, as a language model's are."""
    logits = rng.normal(0.0, rng.uniform(1.0, 4.0), size)
    logits[rng.integers(0, size, rng.integers(1, 30))] += rng.uniform(3.0, 15.0)
    return logits.astype(np.float32)


class UniformTests:
    def test_it_hashes_the_seed_and_position_as_documented(self):
        digest = hashlib.sha256((7).to_bytes(8, "little") + (12).to_bytes(8, "little")).digest()
        assert uniform(7, 12) == (int.from_bytes(digest[:8], "little") >> 11) / 2**53

    def test_it_is_pinned_to_one_known_value(self):
        assert uniform(0, 0) == 0.8344336729487916  # SHA-256 of 16 zero bytes begins 37 47 08 ff f7 71 9d d5

    def test_it_takes_the_seed_modulo_two_to_the_64(self):
        assert uniform(-1, 3) == uniform(2**64 - 1, 3) and uniform(2**64 + 5, 3) == uniform(5, 3)

    def test_it_is_deterministic_and_in_the_unit_interval(self):
        draws = [uniform(seed, position) for seed in range(20) for position in range(50)]
        assert draws == [uniform(seed, position) for seed in range(20) for position in range(50)]
        assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)

    def test_it_refuses_a_negative_position(self):
        with pytest.raises(ValueError):
            uniform(1, -1)


class SelectTests:
    @pytest.mark.parametrize("temperature", [0.0, 0.3, 0.7, 1.2, 2.0])
    @pytest.mark.parametrize("top_p", [1.0, 0.95, 0.9, 0.5, 0.0])
    def test_it_draws_what_the_literal_rule_draws(self, temperature, top_p):
        rng = np.random.default_rng(int(temperature * 10 + top_p * 100))
        for position in range(40):
            logits = logits_like_a_model(rng, int(rng.integers(100, 5000)))
            u = uniform(3, position)
            assert select(logits, temperature=temperature, top_p=top_p, u=u) == reference_select(
                logits, temperature=temperature, top_p=top_p, u=u
            )

    def test_it_draws_over_a_whole_gemma_sized_vocabulary_as_the_literal_rule_does(self):
        rng = np.random.default_rng(5)
        for position, (temperature, top_p) in enumerate([(0.7, 1.0), (1.5, 1.0), (1.0, 0.9), (2.0, 0.95)]):
            logits = logits_like_a_model(rng, 262_144)
            u = uniform(9, position)
            assert select(logits, temperature=temperature, top_p=top_p, u=u) == reference_select(
                logits, temperature=temperature, top_p=top_p, u=u
            )

    def test_greedy_takes_the_lowest_id_of_a_tie(self):
        logits = np.array([1.0, 5.0, 2.0, 5.0], dtype=np.float32)
        assert select(logits, temperature=0.0, top_p=1.0, u=0.99) == 1

    def test_top_p_breaks_equal_weights_by_the_lower_id(self):
        logits = np.zeros(4, dtype=np.float32)  # four equal tokens: top_p 0.5 keeps ids 0 and 1
        assert {select(logits, temperature=1.0, top_p=0.5, u=u) for u in np.linspace(0, 0.999, 50)} == {0, 1}

    def test_the_draw_walks_the_kept_tokens_in_id_order(self):
        logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
        assert [select(logits, temperature=1.0, top_p=1.0, u=u) for u in (0.05, 0.15, 0.69, 0.71)] == [0, 1, 1, 2]

    def test_a_masked_token_is_never_drawn(self):
        logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
        assert {select(logits, temperature=1.5, top_p=1.0, u=u) for u in np.linspace(0, 0.999, 100)} == {1, 3}


class PartsTests:
    def test_a_draw_made_in_parts_is_the_draw_over_the_whole_vocabulary(self) -> None:
        """A vocabulary held in parts (a ring's head and tail, here three uneven parts, one far
        less likely than the others): each part's mass, then the draw within the part that
        holds it, gives select's token."""
        rng = np.random.default_rng(4)
        cuts = [0, 700, 1900, 3000]
        for _ in range(300):
            logits = (rng.standard_normal(3000) * 3).astype(np.float32)
            logits[cuts[1] : cuts[2]] -= rng.uniform(0, 12)  # a part that is rarely drawn, or never
            temperature, u = float(rng.uniform(0.3, 1.5)), float(rng.random())
            parts = [logits[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
            part, within = part_of_draw(
                [part_mass(p, temperature=temperature) for p in parts], temperature=temperature, u=u
            )
            token = cuts[part] + select(parts[part], temperature=temperature, top_p=1.0, u=within)
            assert token == select(logits, temperature=temperature, top_p=1.0, u=u)


class Asked:
    """A mask as a grammar answers it: for an array of ids, whether each is allowed; counts the ids asked about."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask, self.asked = mask, 0

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        self.asked += len(ids)
        return self.mask[ids]


class SelectMaskedTests:
    @pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
    @pytest.mark.parametrize("top_p", [1.0, 0.9])
    @pytest.mark.parametrize("allowed_share", [0.9, 0.3, 0.01])
    def test_it_draws_what_select_draws_over_the_masked_logits(self, temperature, top_p, allowed_share):
        rng = np.random.default_rng(int(temperature * 10 + top_p * 100 + allowed_share * 1000))
        for position in range(30):
            logits = logits_like_a_model(rng, int(rng.integers(2000, 20_000)))
            mask = rng.random(len(logits)) < allowed_share
            mask[rng.integers(len(logits))] = True
            u = uniform(11, position)
            expected = select(np.where(mask, logits, -np.inf), temperature=temperature, top_p=top_p, u=u)
            assert select_masked(logits, Asked(mask), temperature=temperature, top_p=top_p, u=u) == expected

    def test_a_likely_allowed_token_is_settled_without_asking_about_every_token(self):
        rng = np.random.default_rng(4)
        asked_in_all = []
        for position in range(40):
            logits = logits_like_a_model(rng, 262_144)
            logits[rng.integers(len(logits))] += 30.0  # one token far ahead, as in most steps of a JSON answer
            asked = Asked(np.ones(len(logits), dtype=bool))
            u = uniform(2, position)
            assert select_masked(logits, asked, temperature=0.8, top_p=1.0, u=u) == select(
                logits, temperature=0.8, top_p=1.0, u=u
            )
            asked_in_all.append(asked.asked)
        assert max(asked_in_all) <= sum(LIKELY), asked_in_all

    def test_greedy_breaks_a_tie_past_the_likely_tokens_by_the_lower_id(self):
        logits = np.zeros(5000, dtype=np.float32)  # all tied: only the whole vocabulary settles it
        mask = np.zeros(5000, dtype=bool)
        mask[[4000, 17]] = True
        assert select_masked(logits, Asked(mask), temperature=0.0, top_p=1.0, u=0.5) == 17

    def test_a_mask_that_refuses_every_token_is_an_error(self):
        with pytest.raises(ValueError, match="refuses every token"):
            select_masked(
                np.zeros(3000, dtype=np.float32), Asked(np.zeros(3000, dtype=bool)), temperature=1.0, top_p=1.0, u=0.3
            )


class TokenCheckTests:
    @pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.5])
    @pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
    def test_the_selected_token_always_matches(self, temperature, top_p):
        rng = np.random.default_rng(int(temperature * 10 + top_p * 100))
        for position in range(40):
            logits = logits_like_a_model(rng, 3000)
            u = uniform(11, position)
            token = select(logits, temperature=temperature, top_p=top_p, u=u)
            check = token_check(logits, token, temperature=temperature, top_p=top_p, u=u)
            assert (check.verdict, check.margin) == (MATCH, 0.0)

    @pytest.mark.parametrize("temperature", [0.0, 0.3, 0.7, 1.2, 1.5])
    @pytest.mark.parametrize("top_p", [1.0, 0.9, 0.6])
    def test_an_honest_machine_whose_logits_differ_by_half_the_tie_gap_never_misses(self, temperature, top_p):
        rng = np.random.default_rng(int(temperature * 10 + top_p * 100) + 1)
        for position in range(150):
            logits = logits_like_a_model(rng, 2000)
            if position % 3 == 0:  # a near-tie at the top, the greedy case's hard one
                first, second = np.argsort(-logits)[:2]
                logits[second] = logits[first] - rng.uniform(0.0, TIE_GAP / 2)
            honest = logits + rng.uniform(-TIE_GAP / 2, TIE_GAP / 2, len(logits)).astype(np.float32)
            u = uniform(13, position)
            token = select(honest, temperature=temperature, top_p=top_p, u=u)
            assert token_check(logits, token, temperature=temperature, top_p=top_p, u=u).verdict != MISS

    def test_a_token_far_outside_the_draw_misses_and_says_by_how_much(self):
        logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
        check = token_check(logits, 2, temperature=1.0, top_p=1.0, u=0.05)
        assert check.verdict == MISS and check.margin == pytest.approx(0.65, abs=1e-6)

    def test_a_token_just_past_its_interval_edge_is_uncertain(self):
        logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
        assert token_check(logits, 1, temperature=1.0, top_p=1.0, u=0.0999).verdict == UNCERTAIN

    def test_a_token_outside_the_top_p_set_misses(self):
        logits = np.log(np.array([0.01, 0.6, 0.39], dtype=np.float32))
        assert token_check(logits, 0, temperature=1.0, top_p=0.5, u=0.01).verdict == MISS

    def test_greedy_reads_the_logit_gap(self):
        logits = np.array([1.0, 5.0, 5.0 - TIE_GAP / 2, 4.0], dtype=np.float32)
        verdicts = [token_check(logits, t, temperature=0.0, top_p=1.0, u=0.5) for t in range(4)]
        assert [v.verdict for v in verdicts] == [MISS, MATCH, UNCERTAIN, MISS]
        assert verdicts[3].margin == pytest.approx(1.0)

    def test_the_lower_id_of_a_greedy_tie_matches_and_the_other_is_uncertain(self):
        logits = np.array([5.0, 1.0, 5.0], dtype=np.float32)
        assert [token_check(logits, t, temperature=0.0, top_p=1.0, u=0.5).verdict for t in (0, 2)] == [MATCH, UNCERTAIN]

    def test_a_greedy_answer_to_a_sampled_job_mostly_misses(self):
        rng = np.random.default_rng(17)
        verdicts = []
        for position in range(200):
            logits = logits_like_a_model(rng, 3000)
            greedy = int(np.argmax(logits))
            verdicts.append(token_check(logits, greedy, temperature=1.0, top_p=1.0, u=uniform(1, position)).verdict)
        assert verdicts.count(MISS) > 20
