"""The engine behind the server: one thread owns the `LLMEngine` and runs its step loop.

The LLMEngine is not thread-safe, so only the engine thread touches it. Request handlers on the asyncio loop send it
commands (add, abort) and receive each request's progress as `Output`s on an asyncio queue, handed over with
`loop.call_soon_threadsafe`. The thread sleeps on a condition while there is no work. An exception inside a step
fails the requests that step touched and the loop goes on; if the thread itself dies, every open request is failed
and `alive` turns False (the server's /health says 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from magicdec.engine import LLMEngine
from magicdec.errors import DistributedError, MagicDecError
from magicdec.logprobs import TokenLogprob
from magicdec.sampling import SamplingParams
from magicdec.scheduler import Request, Status

log = logging.getLogger("magicdec.server")


class EngineDeadError(MagicDecError):
    """The engine thread has stopped (shut down, or crashed); no request can be served."""


@dataclass
class Output:
    """What a step did to one request: the tokens it gained and, on the last output, how it ended."""

    request_id: str
    new_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    text: str | None = None  # the final text (`LLMEngine.text_of`) on the last output
    error: str | None = None  # set when the engine failed the request (the last output too)
    cached_tokens: int = 0  # prompt tokens the request took from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # of new_ids, where the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output, where the request asked

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class StepObserver(Protocol):
    """Told on the engine thread about every step and every batch of commands (the server's metrics)."""

    def observe_step(self, engine: LLMEngine, gained: Sequence[tuple[Request, int]]) -> None:
        """After a step, with the requests it changed and how many tokens each gained."""

    def observe_idle(self, engine: LLMEngine) -> None:
        """After commands were applied (queue and slot use may have changed)."""

    def observe_aborted(self, request_id: str) -> None:
        """A request's client went away before it finished."""


class Mirror(Protocol):
    """Under tensor parallelism, what the engine thread tells the other ranks (magicdec.distributed.serving)."""

    heartbeat_s: float
    """The longest the thread may sit idle without a turn (the others would take silence for a hang)."""

    def send(self, turn: list[tuple]) -> None:
        """The commands of a turn, before they are applied (possibly none: a heartbeat)."""

    def stop(self) -> None:
        """Serving is over."""

    def lost(self, error: DistributedError) -> None:
        """A collective failed: the other ranks cannot be trusted to be in step any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0  # output tokens already handed over
    prompt_sent: bool = False  # the prompt's log-probabilities, where asked, went with an output


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: _Stream
    done: asyncio.Future = field(repr=False)

    def mirrored(self) -> tuple:
        return ("add", self.request_id, self.prompt_ids, self.params)


@dataclass
class _Abort:
    request_id: str

    def mirrored(self) -> tuple:
        return ("abort", self.request_id)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Settle a future on its own loop, unless its awaiter has gone (cancelled)."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    """Runs an LLMEngine on a dedicated thread; `add` and `abort` are safe to call from the asyncio loop."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None, mirror: Mirror | None = None):
        self._engine = engine
        self._observer = observer
        self._mirror = mirror
        self.max_model_len = engine.max_model_len  # fixed at construction: safe to read anywhere
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._dead = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self.error: BaseException | None = None  # what killed the engine thread, if anything did
        self._thread = threading.Thread(target=self._run, name="magicdec-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, fail what is still open ("the server is shutting down") and join."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    async def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                  queue: asyncio.Queue) -> None:
        """Queue a request; its Outputs go to `queue`. Raises what `LLMEngine.add_request` raises
        (InvalidRequestError, QueueFullError) or EngineDeadError."""
        loop = asyncio.get_running_loop()
        command = _Add(request_id, list(prompt_ids), params, _Stream(loop, queue), loop.create_future())
        self._submit(command)
        await command.done

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away) and free its slot; finished or unknown ids are ignored."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # nothing runs any more

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._dead or self._stopping:
                raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
            self._commands.append(command)
            self._cond.notify()

    # --- the engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self._engine.has_unfinished()):
                        if not self._cond.wait(self._mirror.heartbeat_s if self._mirror is not None else None):
                            break  # idle for a heartbeat: an empty turn tells the other ranks we are alive
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                if self._mirror is not None:
                    self._mirror.send([command.mirrored() for command in commands])
                for command in commands:
                    self._apply(command)
                if self._observer is not None:
                    self._observer.observe_idle(self._engine)
                if self._engine.has_unfinished():
                    self._step()
        except BaseException as e:  # the loop itself failed: nothing can run any more
            if isinstance(e, DistributedError) and self._mirror is not None:
                self._mirror.lost(e)
            log.exception("the engine thread died")
            self.error = e
            reason = f"the engine stopped: {type(e).__name__}: {e}"
        finally:
            if self._mirror is not None:
                self._mirror.stop()
            with self._cond:
                self._dead = True
                pending, self._commands = self._commands, []
            for command in pending:
                if isinstance(command, _Add):
                    command.stream.loop.call_soon_threadsafe(_resolve, command.done, EngineDeadError(reason))
            for request_id in list(self._streams):
                self._push(request_id, Output(request_id, [], error=reason))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._engine.abort_request(command.request_id)
            if self._streams.pop(command.request_id, None) is not None and self._observer is not None:
                self._observer.observe_aborted(command.request_id)
            return
        loop = command.stream.loop
        try:
            self._engine.add_request(command.request_id, command.prompt_ids, command.params)
        except MagicDecError as e:
            loop.call_soon_threadsafe(_resolve, command.done, e)
            return
        self._streams[command.request_id] = command.stream
        loop.call_soon_threadsafe(_resolve, command.done, None)

    def _step(self) -> None:
        try:
            changed = self._engine.step()
        except DistributedError:
            raise  # not this step's fault: the ranks are out of step, the loop ends
        except Exception as e:  # a bug or a device error: fail this step's requests, keep serving others
            log.exception("an engine step failed")
            self._fail_touched(f"the engine failed while running this request: {type(e).__name__}: {e}")
            return
        if self._observer is not None:  # before the clients hear of the step, so /metrics is never behind them
            self._observer.observe_step(self._engine, [(r, max(0, len(r.output_ids) - self._sent(r))) for r in changed])
        for request in changed:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue  # aborted: nobody is listening
            if request.finished or len(request.output_ids) > stream.sent:
                self._push(request.request_id, self._output(request, stream))

    def _output(self, request: Request, stream: _Stream) -> Output:
        """What the request gained since its last output (its prompt's log-probabilities with the first)."""
        new_ids = request.output_ids[stream.sent :]
        logprobs = request.logprobs[stream.sent :] if request.logprobs is not None else None
        prompt_logprobs = None if stream.prompt_sent else request.prompt_logprobs
        stream.sent, stream.prompt_sent = len(request.output_ids), True
        finished = request.finished
        return Output(request.request_id, new_ids, request.finish_reason if finished else None,
                      self._engine.text_of(request) if finished else None, cached_tokens=request.cached_tokens,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _sent(self, request: Request) -> int:
        stream = self._streams.get(request.request_id)
        return stream.sent if stream is not None else len(request.output_ids)

    def _fail_touched(self, message: str) -> None:
        """Abort every request a failed step may have touched (all that hold a slot) and tell their clients."""
        touched = [r for r in self._engine.requests.values() if r.status is not Status.WAITING]
        for request in touched:
            self._engine.abort_request(request.request_id)
            if request.request_id in self._streams:
                self._push(request.request_id, Output(request.request_id, [], error=message))

    def _push(self, request_id: str, output: Output) -> None:
        """Hand an Output to its request's queue; the last one closes the stream."""
        stream = self._streams.pop(request_id) if output.last else self._streams[request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
