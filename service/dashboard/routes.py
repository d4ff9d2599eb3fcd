"""All the dashboard's routes in one router: the pages (:mod:`.pages`) and the live feed (:mod:`.events`)."""

from __future__ import annotations

from fastapi import APIRouter
from mpflow.service.dashboard import events, pages

router = APIRouter()
router.include_router(pages.router)
router.include_router(events.router)

__all__ = ["router"]
