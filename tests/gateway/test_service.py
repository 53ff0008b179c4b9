"""Deploying into the gateway service: an app may not take a name the gateway's own routes answer."""
import pytest

import ember
from ember.gateway.service import GATEWAY_PATHS, Gateway
from ember.home import Home
from ember.package import build


@pytest.mark.parametrize("name", sorted(GATEWAY_PATHS))
def test_an_app_named_like_a_gateway_route_is_refused(tmp_path, name):
    app = ember.App(name)

    @app.function()
    def f() -> int:
        return 1

    home = Home(tmp_path)
    with pytest.raises(ValueError, match=f"app name '{name}' is taken by the gateway's own /{name} routes"):
        Gateway(home).register(build(app, home))
