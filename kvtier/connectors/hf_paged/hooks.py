"""Per-instance hooks: wrap a method of one object, and put it back.

The connector never patches a transformers class or module: it sets an instance attribute
that shadows one method of one live object (the manager, its cache, its scheduler) and calls
the bound original from there. :meth:`Hooks.restore` deletes those attributes again, so
nothing of the connector outlives it and other managers in the process are untouched.
"""

from __future__ import annotations

from typing import Any, Callable


class Hooks:
    """The instance hooks one connector installed, for :meth:`restore`."""

    def __init__(self) -> None:
        self._installed: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Make ``obj.name(*args)`` call ``wrapper(original, *args)``.

        Raises:
            AttributeError: ``obj`` has no callable ``name`` (the internal moved), or it is
                already hooked.
        """
        original = getattr(obj, name, None)
        if not callable(original):
            raise AttributeError(f"{type(obj).__name__}.{name} is not a method (transformers' internals moved?)")
        if name in vars(obj):
            raise AttributeError(f"{type(obj).__name__}.{name} is already hooked on this instance")

        def hooked(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(obj, name, hooked)
        self._installed.append((obj, name))

    def on_batch_processors(self, manager: Any, install: Callable[[Any], None]) -> None:
        """Call ``install(processor)`` once for every batch processor of ``manager``: the
        current one (a warmed-up manager) and each one it creates later (transformers builds a
        new processor, with a new cache, per ``start()``).

        Raises:
            AttributeError: as :meth:`wrap`.
        """

        def create(original: Any) -> Any:
            processor = original()
            if not self.installed_on(processor.cache):
                install(processor)
            return processor

        self.wrap(manager, "_create_batch_processor", create)
        if manager.batch_processor is not None:
            install(manager.batch_processor)

    def installed_on(self, obj: Any) -> bool:
        return any(o is obj for o, _ in self._installed)

    def restore(self) -> None:
        """Delete every hook (the class methods show through again). Idempotent."""
        while self._installed:
            obj, name = self._installed.pop()
            vars(obj).pop(name, None)
