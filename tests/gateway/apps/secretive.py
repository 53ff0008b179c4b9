"""A test app whose function needs secret `ember-test-token`; it answers with the value the replica was given."""
import os

import ember

app = ember.App("secretive")


@app.function(secrets=["ember-test-token"], scaledown_window=30)
def token() -> str:
    return os.environ["TEST_TOKEN"]
