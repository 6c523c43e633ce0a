"""The per-thread (per-greenlet) stack of running executions."""

from __future__ import annotations

import threading

from celery_redislock._local import ExecutionStack


def test_each_thread_sees_only_its_own_items() -> None:
    stack: ExecutionStack[str] = ExecutionStack()
    stack.push("main")
    seen: list[object] = []
    pushed, checked = threading.Event(), threading.Event()

    def other() -> None:
        seen.append(stack.top)
        stack.push("other")
        pushed.set()
        checked.wait(10)
        seen.append(stack.pop())
        seen.append(stack.pop())

    thread = threading.Thread(target=other)
    thread.start()
    assert pushed.wait(10)
    assert stack.top == "main"
    checked.set()
    thread.join(10)
    assert seen == [None, "other", None]
    assert stack.pop() == "main"
    assert stack.top is None and stack._stacks == {}


def test_nested_pushes_pop_newest_first_and_leave_nothing_behind() -> None:
    stack: ExecutionStack[int] = ExecutionStack()
    stack.push(1)
    stack.push(2)
    assert stack.top == 2
    assert stack.pop() == 2
    assert stack.top == 1
    assert stack.pop() == 1
    assert stack.pop() is None
    assert stack._stacks == {}
