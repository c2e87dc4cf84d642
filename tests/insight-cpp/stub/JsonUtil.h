// Stand-in for Insight's JsonUtil.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
