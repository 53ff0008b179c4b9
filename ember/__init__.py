"""Ember: decorate a function or class, get an HTTPS endpoint that scales to zero."""
from ember.app import App, Cls, Function
from ember.hooks import asgi_app, enter, exit, method, park, wake
from ember.remote import FunctionCall
from ember.spec import FunctionSpec, Retries, SpecError

__all__ = ["App", "Cls", "Function", "FunctionCall", "FunctionSpec", "Retries", "SpecError", "asgi_app", "enter",
           "exit", "method", "park", "wake"]
