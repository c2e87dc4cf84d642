// Stand-in for Insight's ServerLog.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
