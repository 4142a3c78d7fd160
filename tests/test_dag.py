import itertools

from pgflow.dag import find_cycles, root_schedule_conflicts, topological_order


def test_orders_a_diamond() -> None:
    graph = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    order, stuck = topological_order(graph)
    assert stuck == set()
    assert order.index("a") < order.index("b") < order.index("d")
    assert order.index("c") < order.index("d")


def test_reports_the_jobs_on_a_cycle_not_those_behind_it() -> None:
    graph = {"a": ["c"], "b": ["a"], "c": ["b"], "d": ["c"], "root": []}
    order, stuck = topological_order(graph)
    assert order == ["root"]
    assert stuck == {"a", "b", "c", "d"}
    cycles = find_cycles(graph, stuck)
    assert len(cycles) == 1
    cycle = cycles[0]
    assert cycle[0] == cycle[-1]
    assert set(cycle) == {"a", "b", "c"}
    # Run order: each job's upstream comes before it.
    for upstream, job in itertools.pairwise(cycle):
        assert upstream in graph[job]


def test_self_dependency_is_a_cycle() -> None:
    graph = {"a": ["a"]}
    _, stuck = topological_order(graph)
    assert find_cycles(graph, stuck) == [["a", "a"]]


def test_two_separate_cycles_are_both_reported() -> None:
    graph = {"a": ["b"], "b": ["a"], "x": ["y"], "y": ["x"]}
    _, stuck = topological_order(graph)
    assert len(find_cycles(graph, stuck)) == 2


def test_root_schedule_conflict_is_reported_once_where_it_starts() -> None:
    graph = {"r1": [], "r2": [], "join": ["r1", "r2"], "after": ["join"]}
    order, _ = topological_order(graph)
    schedules = {"r1": "0 * * * * UTC", "r2": "5 * * * * UTC"}
    conflicts = root_schedule_conflicts(graph, order, schedules)
    assert list(conflicts) == ["join"]
    assert {root for root, _ in conflicts["join"]} == {"r1", "r2"}


def test_same_schedule_roots_do_not_conflict() -> None:
    graph = {"r1": [], "r2": [], "join": ["r1", "r2"]}
    order, _ = topological_order(graph)
    schedules = {"r1": "0 * * * * UTC", "r2": "0 * * * * UTC"}
    assert root_schedule_conflicts(graph, order, schedules) == {}


def test_large_chain_is_linear() -> None:
    graph = {f"j{i}": [f"j{i - 1}"] if i else [] for i in range(50_000)}
    order, stuck = topological_order(graph)
    assert len(order) == 50_000 and not stuck
