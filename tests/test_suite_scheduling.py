"""How the suite is spread over pytest-xdist's workers (tests/conftest.py): which tests must run one
after another on one worker, and which may run anywhere."""

from conftest import RAY_FILES, schedule_unit


def test_every_test_that_starts_ray_or_a_deployment_shares_one_unit():
    units = {schedule_unit(f"tests/{name}::test_x[1]") for name in RAY_FILES}
    assert units == {"ray"}
    # the deployments (each starts a SuperLink, SuperNodes and Ray) are among them, both module
    # fixtures' tests and the ones that deploy on their own
    lost = "tests/test_deployment.py::test_a_supernode_lost_mid_round_is_left_out_and_the_run_goes_on"
    alone = "tests/test_deployment.py::test_supernodes_in_their_own_network_namespaces_reach_the_superlink_by_address"
    assert schedule_unit(f"{lost}[train]") == schedule_unit(alone) == schedule_unit("tests/test_flwr_run.py::test_y") == "ray"


def test_every_other_test_is_a_unit_of_its_own():
    assert schedule_unit("tests/test_config.py::test_y") == "tests/test_config.py::test_y"
    assert schedule_unit("tests/test_privacy.py::test_z[a]") == "tests/test_privacy.py::test_z[a]"
