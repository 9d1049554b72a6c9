"""CPU lists and binding one thread: the syntax of ``taskset -c``, bad lists named in the
error, and a bound thread (and the threads it starts) confined while the rest of the process
keeps its CPUs."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pdserve.engine.affinity import (
    bind_current_thread,
    check_cpus_exist,
    current_thread_cpus,
    format_cpu_list,
    parse_cpu_list,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", (0,)), ("0-2,5", (0, 1, 2, 5)), (" 3 , 1", (1, 3)), ("4-4,2-3,3", (2, 3, 4))],
)
def test_cpu_lists_parse_and_format_back(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "1,,2", "0-x"])
def test_bad_cpu_lists_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list") as err:
        parse_cpu_list(text)
    assert repr(text) in str(err.value)


def test_cpus_beyond_the_machine_are_refused() -> None:
    n = os.cpu_count() or 1
    check_cpus_exist(range(n), "cpu_bind")
    with pytest.raises(ValueError, match=rf"cpu_bind: CPU\(s\) {n}"):
        check_cpus_exist([0, n], "cpu_bind")


@linux_only
def test_binding_confines_the_thread_and_its_children_only() -> None:
    before = current_thread_cpus()
    target = (before[-1],)
    seen: dict[str, tuple[int, ...]] = {}

    def engine_thread() -> None:
        seen["bound"] = (bind_current_thread(target),)  # type: ignore[assignment]
        seen["self"] = current_thread_cpus()
        child = threading.Thread(target=lambda: seen.update(child=current_thread_cpus()))
        child.start()
        child.join()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == {"bound": (True,), "self": target, "child": target}
    assert current_thread_cpus() == before  # the caller's thread kept its CPUs


def test_binding_nothing_is_a_no_op() -> None:
    before = current_thread_cpus()
    assert bind_current_thread(()) is False
    assert current_thread_cpus() == before
