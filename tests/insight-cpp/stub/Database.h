// Stand-in for Insight's Database.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
