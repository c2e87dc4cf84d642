// Stand-in for Insight's ParserStatusManager.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
