"""The built-in plugins, written against the public API only, as a third party would."""
