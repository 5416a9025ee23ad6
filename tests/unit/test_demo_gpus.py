"""make demo (examples/demo.py) on a GPU host: each agent on its own GPUs, or a clear error."""

from __future__ import annotations

import pytest

from elastic.errors import ConfigError
from examples import demo


def launches(environ, physical):
    return {node: env for node, _, env in demo.agent_launches("http://e:2379", "/w", "/w/p",
                                                              environ, physical)}


def test_each_agent_gets_its_own_two_gpus():
    envs = launches({"PATH": "/bin"}, physical=8)
    assert [envs[n]["CUDA_VISIBLE_DEVICES"] for n in ("a", "b")] == ["0,1", "2,3"]
    assert envs["a"]["PATH"] == "/bin"


def test_the_gpus_given_to_the_demo_are_split_between_the_agents():
    envs = launches({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, physical=8)
    assert [envs[n]["CUDA_VISIBLE_DEVICES"] for n in ("a", "b")] == ["4,5", "6,7"]


def test_without_gpus_the_environment_is_left_alone():
    assert launches({}, physical=0) == {"a": {}, "b": {}}
    assert launches({"CUDA_VISIBLE_DEVICES": ""}, physical=8) == {
        "a": {"CUDA_VISIBLE_DEVICES": ""}, "b": {"CUDA_VISIBLE_DEVICES": ""}}


def test_too_few_gpus_fail_before_anything_starts():
    with pytest.raises(ConfigError, match="at least 4"):
        launches({}, physical=2)
