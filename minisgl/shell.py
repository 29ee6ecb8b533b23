"""`python -m minisgl --shell`: chat with the model in the terminal.

The shell runs the same worker processes as the server and talks to them directly (no HTTP).
The conversation is kept and resent each turn; `/history` shows it, `/reset` forgets it, `/exit`
(or end of input) quits.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from minisgl.config import ServerConfig
from minisgl.core import SamplingParams
from minisgl.message import ChatMessage, EngineInfo
from minisgl.runtime.launch import Workers, running_workers
from minisgl.server.engine_client import EngineClient, EngineUnavailable, RequestRejected
from minisgl.server.metrics import Metrics
from minisgl.server.sampling import generate_req

HELP = "Type a message. /history shows the conversation, /reset clears it, /exit quits."
PROMPT = ">>> "
WATCH_PERIOD_S = 0.2


class Shell:
    def __init__(self, client: EngineClient, out: TextIO) -> None:
        self.client = client
        self.out = out
        self.history: list[ChatMessage] = []
        # Greedy: a small model rambles when sampled, and answers repeat from run to run.
        self.params = SamplingParams(temperature=0.0)

    async def reply(self, text: str) -> str:
        """Send one user turn; stream the answer to `out` and keep both in the history."""
        self.history.append(ChatMessage("user", text))
        req = generate_req(1, None, self.params, None, None, messages=list(self.history))
        stream = self.client.submit([req])
        parts: list[str] = []
        try:
            async for batch in stream:
                for co in batch:
                    parts.append(co.out.text)
                    self.out.write(co.out.text)
                    self.out.flush()
        except RequestRejected as e:
            self.history.pop()
            self.out.write(f"[refused: {e}]")
        finally:
            stream.close()
        self.out.write("\n")
        answer = "".join(parts)
        if parts:
            self.history.append(ChatMessage("assistant", answer))
        return answer

    async def run(self, inp: TextIO) -> None:
        self.out.write(HELP + "\n")
        while True:
            self.out.write(PROMPT)
            self.out.flush()
            line = await asyncio.to_thread(inp.readline)
            if not line:  # end of input
                self.out.write("\n")
                return
            text = line.strip()
            if text == "/exit":
                return
            if text == "/reset":
                self.history.clear()
                self.out.write("(conversation cleared)\n")
            elif text == "/history":
                self.show_history()
            elif text:
                await self.reply(text)

    def show_history(self) -> None:
        if not self.history:
            self.out.write("(no conversation yet)\n")
        for m in self.history:
            self.out.write(f"{m.role}: {m.content}\n")


async def _watch(workers: Workers, client: EngineClient) -> None:
    """Fail the turn in flight, and every later one, once a worker process dies."""
    while (reason := workers.failure()) is None:
        await asyncio.sleep(WATCH_PERIOD_S)
    client.fail_all(reason)


async def _main(workers: Workers, info: EngineInfo) -> None:
    client = EngineClient(workers.ipc, Metrics())
    client.start()
    watch = asyncio.create_task(_watch(workers, client))
    try:
        print(f"minisgl shell: {info.model_name}", file=sys.stdout)
        await Shell(client, sys.stdout).run(sys.stdin)
    except EngineUnavailable as e:
        print(f"\nminisgl: the engine stopped: {e.reason}", file=sys.stderr)
    finally:
        watch.cancel()
        await client.stop()


def run_shell(config: ServerConfig) -> None:
    with running_workers(config) as (workers, info):
        asyncio.run(_main(workers, info))
