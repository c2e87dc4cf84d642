// Stand-in for Insight's TimelineProtocolEvent.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
