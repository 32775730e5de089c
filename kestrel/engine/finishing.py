"""When a request ends: the one decision for EOS, stop token ids, length, stop strings and grammar end.

`Finishing.decide` is asked after each token a request takes (by `Scheduler.resolve`, for plain and
speculative steps alike), and once before its first token (`Scheduler.finish_if_done`: at admission,
after a compile, after a prefill that only scored the prompt). Aborts, failures and retraction end or
pause requests for reasons of their own, outside this decision.
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel.core.request import Request
from kestrel.engine.detokenizer import OutputText


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop", "length" or "error"
    matched_stop: int | str | None = None  # the stop token id or stop string, for "stop"
    error: str | None = None


class Finishing:
    def __init__(self, eos_token_ids: set[int], context_length: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        # rid -> the request's text as it grows: kept only for requests with stop strings (the others are
        # detokenized once, at the end).
        self.texts: dict[str, OutputText] = {}

    def at_length_limit(self, req: Request, generated: int, seq_len: int) -> bool:
        return generated >= req.params.max_new_tokens or seq_len >= self.context_length

    def decide(self, req: Request, token: int | None = None) -> Finish | None:
        """Whether `req` ends here. `token`: the token it has just taken (the last of its output); its
        grammar matcher and stop-string text take it too. None: before any token, where a request with
        nothing to generate ends once its prompt needs no forward (none asked for its logprobs or its
        pooling, or they are done), and one whose grammar allows only the empty string ends at once.

        Of the reasons that meet at one token, a stop string wins, then the grammar's end, then a stop
        token id or EOS (the grammar does not take those), then the length limit."""
        params = req.params
        if token is None:
            scoring = params.prompt_logprobs is not None or params.pooling is not None
            if not params.max_new_tokens and (not scoring or req.kv_len >= len(req.prompt_ids)):
                return Finish("length")
            if req.grammar is not None and not req.grammar.waiting and req.grammar.ended():
                return Finish("stop")
            return None
        finish = None
        if params.stop_token_ids and token in params.stop_token_ids:
            finish = Finish("stop", token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            finish = Finish("stop", token)
        # Resolved tokens only: a token launched after this one may still be pending.
        elif self.at_length_limit(req, len(req.output_ids), len(req.prompt_ids) + len(req.output_ids)):
            finish = Finish("length")
        if req.grammar is not None and (finish is None or finish.reason == "length"):
            if not req.grammar.accept(token):  # the mask allowed it: only a bug gets here
                if finish is None:
                    finish = Finish("error", error=f"the grammar rejected token {token}")
            elif req.grammar.ended():
                finish = Finish("stop")
        text = self.texts.get(req.rid)
        if text is not None:
            # Before min_new_tokens no stop string is looked for (a match would be final: the text ends there).
            _, matched = text.add([token], match=len(req.output_ids) >= params.min_new_tokens)
            if matched is not None:
                finish = Finish("stop", matched)
        return finish
