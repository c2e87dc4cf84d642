// Stand-in for Insight's StringUtil.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
