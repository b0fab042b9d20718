"""The bounded output stream between the engine thread and its asyncio consumers."""

import asyncio
import threading

from jaxserve.host.stream import OutputStream, RequestOutput, notify


def test_a_step_wakes_all_its_asyncio_consumers_with_one_loop_call():
    """Pushes without `wake` leave the consumers asleep; one `notify` from the engine
    thread wakes them all with a single `call_soon_threadsafe`."""

    async def body():
        loop = asyncio.get_running_loop()
        calls = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal calls
            calls += 1
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted
        streams = [OutputStream(f"req-{i}", 4, loop) for i in range(3)]
        readers = [asyncio.create_task(anext(aiter(s))) for s in streams]
        await asyncio.sleep(0.01)  # every reader waits

        async def on_engine_thread(fn):  # not to_thread: it calls the loop itself
            thread = threading.Thread(target=fn)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.001)

        def step():
            for s in streams:
                s.push(RequestOutput(s.request_id, (7,), "x"), wake=False)

        await on_engine_thread(step)
        done, _ = await asyncio.wait(readers, timeout=0.1)
        assert not done and calls == 0
        await on_engine_thread(lambda: notify(streams))
        outputs = await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert [o.request_id for o in outputs] == ["req-0", "req-1", "req-2"]
        assert calls == 1

    asyncio.run(body())


def test_outputs_past_capacity_merge_into_one_and_a_final_output_stays_apart():
    """A consumer that falls behind is never refused: past `capacity` unread outputs,
    each new one joins the last (tokens, text, logprobs, steps; the last one's time).
    The first output, whose time is the TTFT, is never merged into."""
    stream = OutputStream("req", capacity=2)

    def out(i, reason=None, queue=None):
        return RequestOutput("req", (i,), f"<{i}>", reason, 3, (-i / 10,), ({i: -i / 10},),
                             queue_seconds=queue, time=100.0 + i)

    stream.push(out(1, queue=0.5))
    for i in range(2, 6):
        stream.push(out(i))
    stream.push(out(6, "length"))
    assert len(stream) == 3
    first, merged, final = (stream.get(1) for _ in range(3))
    assert first == out(1, queue=0.5)
    assert merged == RequestOutput(
        "req", (2, 3, 4, 5), "<2><3><4><5>", None, 3, (-0.2, -0.3, -0.4, -0.5),
        ({2: -0.2}, {3: -0.3}, {4: -0.4}, {5: -0.5}), time=105.0, num_steps=4,
    )
    assert final == out(6, "length")
    # read as it comes, nothing merges; capacity 1 still keeps the first output apart
    stream = OutputStream("req", capacity=1)
    stream.push(out(1, queue=0.5))
    stream.push(out(2))
    stream.push(out(3))
    assert [o.token_ids for o in (stream.get(1), stream.get(1))] == [(1,), (2, 3)]
    stream.push(out(4))
    assert stream.get(1) == out(4)


def test_a_lazy_consumer_is_woken_for_a_half_full_buffer_or_the_final_output():
    """A non-streaming request's consumer is not woken for every token."""

    async def body():
        loop = asyncio.get_running_loop()
        lazy = OutputStream("req", capacity=4, loop=loop, lazy=True)
        reader = asyncio.create_task(anext(aiter(lazy)))
        await asyncio.sleep(0.01)

        async def push_and_notify(item):
            thread = threading.Thread(target=lambda: (lazy.push(item, wake=False), notify([lazy])))
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # room for a wake-up, if one was sent

        await push_and_notify(RequestOutput("req", (1,), "a"))
        assert not reader.done()  # one of four: not woken
        await push_and_notify(RequestOutput("req", (2,), "b"))
        assert reader.done() and reader.result().text == "a"  # half full: woken
        rest = asyncio.create_task(anext(aiter(lazy)))
        assert (await rest).text == "b"
        last = asyncio.create_task(anext(aiter(lazy)))
        await asyncio.sleep(0.01)
        await push_and_notify(RequestOutput("req", (3,), "c", "length"))
        assert last.done() and last.result().finish_reason == "length"  # final: woken

    asyncio.run(body())
