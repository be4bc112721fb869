"""Converters (`edgespec.converters`): write bundles, Core ML drafter packages and distilled
drafters; they import the runtime, never the reverse."""
