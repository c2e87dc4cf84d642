// Stand-in for Insight's WsSender.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
