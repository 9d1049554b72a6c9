"""Per-token stop rules and the construction of RequestOutputs (text deltas, logprobs).

Stop rules, in order: nothing but the length limits before ``min_tokens`` outputs; a stop
token id or EOS (unless ``ignore_eos``) ends the request without adding text; a stop string
ends it with the text cut where the stop string starts (it may span several tokens); then
``max_tokens`` and ``max_model_len``. While a request has stop strings, the last
``len(longest stop) - 1`` characters are held back from the stream, so streamed text is
always a prefix of the final text. No tensors here.
"""

from __future__ import annotations

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The request's state after ``token_id`` was appended (None: keep going).

    Feeds the token to the detokenizer unless it is a stop token (which adds no text).
    Nothing is checked but the length limits before ``min_tokens`` tokens exist.
    """
    params = request.params
    num_out = request.num_output_tokens
    past_min = num_out >= params.min_tokens
    is_stop_token = token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in request.eos_token_ids
    )
    if past_min and is_stop_token:
        return RequestStatus.FINISHED_STOPPED  # the stop token adds no text
    detok = request.detokenizer
    if detok is not None:
        old_len = len(detok.text)
        detok.append(token_id)
        if params.stop and past_min:
            index = find_stop(detok.text, params.stop, old_len)
            if index is not None:
                request.stop_text_index = index
                return RequestStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def make_output(request: Request) -> RequestOutput:
    """The output for what is new since the last one; records what was emitted."""
    params = request.params
    finished = request.is_finished
    text = request.detokenizer.text if request.detokenizer is not None else ""
    if request.stop_text_index is not None:
        text = text[: request.stop_text_index]
    elif not finished:
        text = text[: max(len(request.emitted_text), len(_streamable(text, params.stop)))]
    delta = text[len(request.emitted_text) :]
    request.emitted_text = text
    new_ids = request.output_token_ids[request.num_emitted_tokens :]
    request.num_emitted_tokens = request.num_output_tokens
    logprobs = None
    if params.logprobs is not None:
        logprobs = request.output_logprobs[request.num_emitted_logprobs :]
        request.num_emitted_logprobs = len(request.output_logprobs)
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        new_token_ids=new_ids,
        token_ids=list(request.output_token_ids),
        text_delta=delta,
        text=text,
        logprobs=logprobs,
        finished=finished,
        finish_reason=request.status.finish_reason,
        num_cached_tokens=request.num_cached_tokens,
        arrival_time=request.arrival_time,
        first_token_time=request.first_token_time,
        num_preemptions=request.num_preemptions,
    )


def prior_streamed_text(request: Request) -> str:
    """The text an uninterrupted run had streamed when it had produced the prior outputs (a
    migrated request's, replayed by its detokenizer): all of it but a stop-string hold."""
    text = request.detokenizer.text if request.detokenizer is not None else ""
    return _streamable(text, request.params.stop)


def _streamable(text: str, stops: list[str]) -> str:
    """``text`` less what could still become the start of a stop string."""
    if not stops:
        return text
    hold = max(len(s) for s in stops) - 1
    return text[: max(0, len(text) - hold)]


def find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Earliest index of a stop string that ends in the text added after ``old_len``."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, old_len - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
