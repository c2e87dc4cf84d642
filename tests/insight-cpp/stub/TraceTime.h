// Stand-in for Insight's TraceTime.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
