"""How many KV tokens the admitted requests will still need: the room admission keeps free.

A request that ignores EOS and has no stop condition runs to max_new_tokens: its need is known, and so
is the moment it frees its KV, so the room kept is the exact peak of those requests' occupancy. Other
requests may stop any time: each counts a fraction of its remaining max_new_tokens (SGLang's "new token
ratio"), which starts high, decays with every decode step and is re-estimated at each retraction.
"""
from __future__ import annotations

from kestrel.config import SchedulerConfig
from kestrel.core.request import Request

# New-token-ratio estimate: start at INIT x conservativeness, fall linearly to MIN over DECAY_STEPS
# decode steps; a request's remaining budget counts at most CLIP_NEW_TOKENS.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_NEW_TOKENS = 4096

ReserveTerms = tuple[int, list[tuple[int, int]]]


def runs_to_max_new_tokens(req: Request) -> bool:
    p = req.params
    return p.ignore_eos and not p.stop_token_ids and not p.stop_strs


class AdmissionBudget:
    def __init__(self, config: SchedulerConfig, page_size: int) -> None:
        self.conservativeness = config.schedule_conservativeness
        self.page_size = page_size
        self.init_ratio = INIT_NEW_TOKEN_RATIO * self.conservativeness
        self.min_ratio = min(MIN_NEW_TOKEN_RATIO * self.conservativeness, self.init_ratio)
        self.new_token_ratio = self.init_ratio

    def reserve_terms(self, reqs: list[Request]) -> ReserveTerms:
        """The parts of `tokens_to_come` for reqs: the tokens that simply add up (the unplaced rest of
        each sequence, rounded to pages, and the ratio estimate of requests that may stop early), and
        (tokens left, seq_len) of each request that runs to max_new_tokens."""
        flat, known = 0, []
        for r in reqs:
            seq_len = r.seq_len
            flat += seq_len - r.kv_len - r.extend_len + self.page_size - 1
            if runs_to_max_new_tokens(r):
                known.append((max(0, r.params.max_new_tokens - r.num_generated), seq_len))
            else:
                flat += self.expected_new_tokens(r)
        return flat, known

    def tokens_to_come(self, running: ReserveTerms, reqs: list[Request]) -> int:
        """KV tokens that the running requests (given as their `reserve_terms`) and reqs will need
        beyond the slots they hold now, at the fullest moment ahead: the rest of each sequence (this
        step's decode token, prompt chunks still to prefill) rounded to pages, plus the tokens they will
        generate, which schedule_conservativeness scales."""
        flat, known = self.reserve_terms(reqs)
        known = sorted(running[1] + known, reverse=True)
        # s steps ahead, the requests that run to max_new_tokens and are not done hold sum(seq_len + s);
        # that peaks just before one of them finishes and frees its KV. Visit those moments, latest first.
        held = peak = 0
        for count, (left, seq_len) in enumerate(known, 1):
            held += seq_len
            peak = max(peak, held + count * left)
        return running[0] + flat + int((peak - held) * self.conservativeness)

    def expected_new_tokens(self, req: Request) -> int:
        left = min(req.params.max_new_tokens - req.num_generated, CLIP_NEW_TOKENS)
        return int(max(0, left) * self.new_token_ratio)

    def decay(self) -> None:
        """One decode step went by."""
        step = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - step)

    def re_estimate(self, running: list[Request], headroom_steps: int) -> None:
        """The estimate let the pool overflow. The requests left have used this share of their budgets
        so far (with the headroom): a lower bound of what they will use in the end, and the estimate to
        decay from. (Resetting to the start value instead made the ratio cycle.)"""
        generated = sum(r.num_generated for r in running) + headroom_steps * len(running)
        share = generated / max(1, sum(r.params.max_new_tokens for r in running))
        self.new_token_ratio = min(1.0, share) * self.conservativeness
