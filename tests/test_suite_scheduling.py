"""How the suite is spread over pytest-xdist's workers (tests/conftest.py): which tests must run one
after another on one worker, and which may run anywhere."""

from conftest import RAY_FILES, SHARED_FIXTURES, _shared_fixture_users, schedule_unit


def test_every_test_that_starts_a_local_ray_instance_shares_one_unit():
    units = {schedule_unit(f"tests/{name}::test_x[1]", {}) for name in RAY_FILES}
    assert units == {"ray"}


def test_tests_that_read_a_shared_deployment_share_a_unit_and_the_others_run_alone():
    users = {path: _shared_fixture_users(path, fixtures) for path, fixtures in SHARED_FIXTURES.items()}
    deployment = users["tests/test_deployment.py"]
    # read from the test file: the four TLS tests take tls_run, the lost-SuperNode test lost_run
    assert sorted(name for name, f in deployment.items() if f == "tls_run") == [
        "test_deployment_reproduces_the_in_process_run_exactly",
        "test_each_host_loads_its_models_once",
        "test_the_hosts_ray_ran_with_token_authentication",
        "test_two_fedtops_rounds_over_tls_with_authentication",
    ]
    lost = "tests/test_deployment.py::test_a_supernode_lost_mid_round_is_left_out_and_the_run_goes_on"
    assert schedule_unit(f"{lost}[train]", users) == schedule_unit(f"{lost}[query.score]", users) == "tests/test_deployment.py::lost_run"
    alone = "tests/test_deployment.py::test_supernodes_in_their_own_network_namespaces_reach_the_superlink_by_address"
    assert schedule_unit(alone, users) == alone
    assert schedule_unit("tests/test_config.py::test_y", users) == "tests/test_config.py::test_y"
