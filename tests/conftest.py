import pytest

from asyncroll.types import RolloutGroup
from tests.factories import make_group


@pytest.fixture
def group() -> RolloutGroup:
    return make_group()
